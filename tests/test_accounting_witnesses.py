"""Mutations of a real run that lose samples, each applied through a subclass of
the rollout actor (the code itself untouched), and the accounting that must
catch them: ``AccountingError`` within a few steps, naming the term that does
not balance with numbers that show it, never a hang (``policies/accounting.py``).

    a sample dropped in the actor before any count   the report is short of the group
                                                     asked for; the actor's own
                                                     received != generated + working
    one sample fewer put than counted queued         the queue's put is short of the
                                                     actors' queued: the queue is named

and a checkpoint never files a shortfall it cannot explain as in flight.
"""

from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace
from typing import Any

import pytest

import loop
from actors.launch import launch
from actors.rollout import RolloutActor
from contracts.rollout import GroupReport, GroupRequest, RolloutCounts
from contracts.sample import Sample
from policies.base import AccountingError

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHORT = ["trainer.batch_prompts=2", "rollout.n=4", "run.progress=false", "rollout.max_response_tokens=8",
         "runtime.type=local"]
SCHEDULES = ["fully_async", "sync"]
LOSE_AT = 5  # the group (counted from 1) the mutated actor loses a sample of: after the first step's two


class LosesASampleBeforeAnyCount(RolloutActor):
    """A mutant: one generated sample of its ``LOSE_AT``-th group vanishes on the way
    from generation to the group's counts (as a bug in between would lose it)."""

    groups = 0

    async def _generate(self, group: GroupRequest) -> list[Sample]:
        samples = await super()._generate(group)
        LosesASampleBeforeAnyCount.groups += 1
        return samples[:-1] if LosesASampleBeforeAnyCount.groups == LOSE_AT else samples


class PutsOneShort(RolloutActor):
    """A mutant: its ``LOSE_AT``-th group goes into the queue one sample short, and it
    counts the whole group queued."""

    groups = 0

    async def _put(self, samples: list[Sample]) -> None:
        PutsOneShort.groups += 1
        await super()._put(samples[:-1] if PutsOneShort.groups == LOSE_AT else samples)


def _train_until_it_raises(monkeypatch: pytest.MonkeyPatch, mutant: type, schedule: str,
                           tmp_path: pathlib.Path) -> tuple[AccountingError, int]:
    """Train with every rollout actor a ``mutant``; the error and the steps done."""
    mutant.groups = 0
    monkeypatch.setattr("actors.wiring.RolloutActor", mutant)
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"policy.type={schedule}", f"run.output_dir={tmp_path}")
    with run:
        with pytest.raises(AccountingError) as caught:
            run.train(steps=10)
        return caught.value, run.policy.step


def _numbers_do_not_balance(message: str, pattern: str) -> None:
    """``pattern``'s groups are (left, right terms...) of what the message says does not balance."""
    m = re.search(pattern, message)
    assert m, message
    left, *right = (int(x) for x in m.groups())
    assert left != sum(right), message


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.timeout(120)
def test_a_sample_lost_in_the_actor_before_any_count_raises_naming_the_short_group(
        schedule: str, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    err, steps = _train_until_it_raises(monkeypatch, LosesASampleBeforeAnyCount, schedule, tmp_path)
    assert steps <= 5
    assert re.fullmatch(r"group g\d+: the policy asked rollout actor rollout-0 for 4 samples, its report counts 3 "
                        r"\(queued 0 \+ dropped 3\): 1 lost in the actor", str(err)), err
    _numbers_do_not_balance(str(err), r"for (\d+) samples, its report counts (\d+)")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.timeout(120)
def test_one_sample_put_short_raises_naming_the_queue(schedule: str, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: pathlib.Path) -> None:
    err, steps = _train_until_it_raises(monkeypatch, PutsOneShort, schedule, tmp_path)
    assert steps <= 5
    assert re.fullmatch(r"the queue registered put=(\d+), 1 fewer than the \d+ samples the rollout actors counted "
                        r"queued: lost between the actors and the queue", str(err)), err
    m = re.search(r"put=(\d+), 1 fewer than the (\d+)", str(err))
    assert int(m[1]) + 1 == int(m[2])


# -- the same checks on a schedule without actors: each identity alone ------------------------------


class _FakeQueue:
    """A fake queue (named as one): ``put`` samples registered, all pending."""

    def __init__(self, put: int) -> None:
        self.put = put

    async def statistics_async(self) -> Any:
        return SimpleNamespace(put=self.put, pending=self.put, in_flight=0, consumers={}, dropped_by_reason={})


def _policy(put: int) -> Any:
    from policies.baselines import SyncPolicy
    from policies.config import PolicyConfig, TaskConfig

    cfg = SimpleNamespace(run=SimpleNamespace(seed=0, log_samples_every=0),
                          rollout=SimpleNamespace(n=4, max_respawns=0), policy=PolicyConfig(), task=TaskConfig())
    return SyncPolicy(cfg, rollouts=[], trainer=None, queue=_FakeQueue(put), task=None, weight_sync=None)


def test_a_report_on_a_group_never_sent_out_raises() -> None:
    policy = _policy(put=0)
    with pytest.raises(AccountingError, match=r"^rollout actor r0 reported group g7, which is not out"):
        policy.on_group(GroupReport(group_id="g7", num_samples=4, num_queued=4), "r0")


def test_an_actor_whose_received_runs_ahead_of_its_work_fails_the_step_check() -> None:
    """Its report adds up (4 = 4 + 0), but it received 8 and accounts for 4 done and none
    working: a group's samples vanished inside it without a report."""
    policy = _policy(put=4)
    policy.group_sent(GroupRequest(group_id="g0", prompt_ids=[1], n=4), "r0")
    policy.on_group(GroupReport(group_id="g0", num_samples=4, num_queued=4,
                                counts=RolloutCounts(received=8, generated=4, queued=4)), "r0")
    with pytest.raises(AccountingError, match=r"^rollout actor r0: received=8 != generated=4 \+ working=0: 4 "
                                              r"samples lost in the actor before any other count$"):
        loop.run(policy.check_accounting())


def test_a_queue_holding_more_than_the_groups_out_can_explain_fails_the_step_check() -> None:
    policy = _policy(put=12)
    policy.group_sent(GroupRequest(group_id="g0", prompt_ids=[1], n=4), "r0")
    policy.group_sent(GroupRequest(group_id="g1", prompt_ids=[1], n=4), "r0")
    policy.on_group(GroupReport(group_id="g0", num_samples=4, num_queued=4,
                                counts=RolloutCounts(received=8, working=4, generated=4, queued=4)), "r0")
    with pytest.raises(AccountingError, match=r"^the queue registered put=12 > reported queued=4 \+ out=4 \(groups "
                                              r"out: g1@r0\)"):
        loop.run(policy.check_accounting())
    policy.queue.put = 8  # g1's put landed, its report on its way: in tolerance, named
    assert loop.run(policy.check_accounting()) == 8


def test_a_checkpoint_files_only_the_groups_out_as_in_flight_and_refuses_any_other_shortfall() -> None:
    policy = _policy(put=4)
    for gid in ("g0", "g1"):
        policy.group_sent(GroupRequest(group_id=gid, prompt_ids=[1], n=4), "r0")
    policy.on_group(GroupReport(group_id="g0", num_samples=4, num_queued=4,
                                counts=RolloutCounts(received=8, working=4, generated=4, queued=4)), "r0")
    queue = SimpleNamespace(put=4, consumers={}, dropped_by_reason={})
    state = policy.state_dict(queue)
    assert state["num_in_flight_dropped"] == 4 and state["rollout_dropped"] == {"in_flight_at_checkpoint": 4}

    policy.admitted += 4  # a mutant ledger: 4 admitted samples in no group out and no report
    with pytest.raises(AccountingError, match=r"^admitted=12 != reported=4 \+ out=4 \(groups out: g1@r0"):
        policy.state_dict(queue)
    policy.admitted -= 4
    with pytest.raises(AccountingError, match=r"^checkpoint: the queue registered put=0, the reports before it 4 "
                                              r"queued; the difference -4 is not within the 4 samples of the groups out"):
        policy.state_dict(SimpleNamespace(put=0, consumers={}, dropped_by_reason={}))
