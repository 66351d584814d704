"""Faults injected into real runs; after each, nothing is lost: every sample
produced was trained, dropped with a counted reason, or is pending
(``produced == trained + dropped + pending``, and the queue's own identity).

    a rollout actor killed mid-generation   its groups counted ``actor_died``; the run goes on
                                            with the other, or stops with one line if none is left
                                            (``rollout.max_respawns=0``); else a replacement joins
                                            at the next push (at once if none is left); under every
                                            schedule (fully_async, sync, one_step_off)
    a weight push that fails half way       engines back on the old version, counted; training goes on
    a user reward that hangs                timed out, counted ``reward_timeout``; the run goes on
    the trainer killed mid-step             its leased batch back in the queue; one-line error

and each rollout actor's own count adds up (``generated == queued + dropped
before the queue``; a dead actor's as last seen). A negative control: a fake
report that under-reports ``queued`` fails the check, naming the actor.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import pathlib
import signal
import threading
import time
from typing import Any

import pytest

import loop
from actors.launch import launch
from contracts.rollout import GroupReport, GroupRequest, RolloutCounts
from policies.base import AccountingError, ActorLostError

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHORT = ["trainer.batch_prompts=2", "rollout.n=4", "run.progress=false", "rollout.max_response_tokens=8"]
PROCESS = ["runtime.type=process", "transfer_queue.deployment=local"]
NO_RESPAWN = ["rollout.max_respawns=0"]
SCHEDULES = ["fully_async", "sync", "one_step_off"]  # every schedule handles a rollout actor that dies


def _assert_nothing_lost(run: Any, stopped: bool = False) -> None:
    """Every record's identity, the policy's check now, the queue's own identity, and
    each rollout actor's (the dead ones' as last seen). ``stopped``: the run goes on,
    check it between train calls (``run.check``: the actors' queued against the
    queue's put, exactly)."""
    for m in run.history:
        assert m["produced"] == m["trained"] + sum(m["dropped"].values()) + m["pending"], m
    loop.run(run.policy.check_accounting())
    if stopped:
        run.check()
    s = loop.run(run.queue.statistics_async())
    assert s.put == s.delivered + s.dropped + s.pending + s.in_flight, s
    for name, c in run.policy.rollout_counts.items():
        assert c.generated == c.queued + sum(c.dropped.values()), (name, c)


# -- a rollout actor dies ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.timeout(120)
def test_a_rollout_actor_killed_mid_generation_is_counted_and_the_run_goes_on_with_the_other(schedule, tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, *PROCESS, *NO_RESPAWN, "rollout.num_actors=2",
                 f"policy.type={schedule}", f"run.output_dir={tmp_path}")
    with run:
        run.train(steps=2)
        policy = run.policy
        victim = policy.rollouts[1]
        pid = loop.run(victim.ping())
        generate = victim.generate_group
        in_flight_at_kill: list[bool] = []

        async def killed_mid_generation(group):
            if in_flight_at_kill:
                return await generate(group)
            # paused, the actor holds the request unanswered however long the driver's loop stalls
            # (else its reply could already be on the way when the kill lands, and nothing is lost)
            await victim.pause()
            call = asyncio.ensure_future(generate(group))
            await asyncio.sleep(0.005)  # the request is in the actor
            in_flight_at_kill.append(not call.done())
            os.kill(pid, signal.SIGKILL)
            return await call

        victim.generate_group = killed_mid_generation
        records = run.train(steps=3)

        assert in_flight_at_kill == [True]
        assert [h.name for h in policy.rollouts] == ["rollout-0"]
        assert len(policy.lost_rollouts) == 1 and "rollout-1" in policy.lost_rollouts[0]
        assert "exit code -9" in policy.lost_rollouts[0]
        assert [m["step"] for m in records] == [3, 4, 5]
        assert records[-1]["trained"] == 5 * policy.batch_request().batch_size  # every batch whole
        # its groups: never put (dropped here), or put and not reported (dropped by the queue); whole groups
        queue_dropped = loop.run(run.queue.statistics_async()).dropped_by_reason
        died = records[-1]["dropped"].get("actor_died", 0) + queue_dropped.get("actor_died", 0)
        assert died >= run.cfg.rollout.n and died % run.cfg.rollout.n == 0
        assert records[-1]["lost_rollout_actors"] == 1
        # the weight group was re-formed without the dead actor: the last push reached the live one
        assert records[-1]["sync/version"] == 5 and "sync/failed" not in records[-1]
        assert loop.run(policy.rollouts[0].get_version()) == 5
        assert set(policy.rollout_counts) == {"rollout-0", "rollout-1"}  # the dead one's, as last seen
        _assert_nothing_lost(run, stopped=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.timeout(120)
def test_the_last_rollout_actor_dying_stops_the_run_with_a_one_line_error(schedule, tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, *PROCESS, *NO_RESPAWN, f"policy.type={schedule}",
                 f"run.output_dir={tmp_path}")
    with run:
        run.train(steps=1)
        os.kill(loop.run(run.policy.rollouts[0].ping()), signal.SIGKILL)
        t0 = time.perf_counter()
        with pytest.raises(ActorLostError, match=r"^every rollout actor died \(rollout-0: .*exit code -9") as info:
            run.train(steps=5)
        assert time.perf_counter() - t0 < 30  # not a hang
        assert "\n" not in str(info.value)
        assert run.policy.rollouts == []
        _assert_nothing_lost(run)


def _train_until(run: Any, done: Any, max_steps: int = 200) -> list[dict]:
    """Steps until ``done()`` (a replacement is set up in its own process meanwhile)."""
    records: list[dict] = []
    while not done():
        assert len(records) < max_steps, "no replacement joined"
        records += run.train(steps=1)
    return records


def _on_the_trainers_weights(run: Any) -> None:
    policy = run.policy
    version = loop.run(policy.trainer.get_version())
    assert [loop.run(h.get_version()) for h in policy.rollouts] == [version] * len(policy.rollouts)
    want = loop.run(policy.trainer.weights_digest(run.cfg.rollout.engine.dtype))
    assert all(loop.run(h.weights_digest()) == want for h in policy.rollouts)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.timeout(180)
def test_a_killed_rollout_actor_is_replaced_and_its_replacement_joins_at_a_push_on_the_trainers_weights(
        schedule, tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, *PROCESS, "rollout.num_actors=2", f"policy.type={schedule}",
                 f"run.output_dir={tmp_path}")
    with run:
        run.train(steps=2)
        policy = run.policy
        dead_pid = loop.run(policy.rollouts[1].ping())
        os.kill(dead_pid, signal.SIGKILL)
        records = _train_until(run, lambda: policy.num_respawns == 1 and len(policy.rollouts) == 2)
        assert [h.name for h in policy.rollouts] == ["rollout-0", "rollout-2"]  # a name (and seed) of its own
        assert records[-1]["lost_rollout_actors"] == 1 and records[-1]["respawned_rollout_actors"] == 1
        assert records[-1]["sync/joined"] == 1 and records[-1]["sync/kind"] == "full"  # not at a delta's base
        _on_the_trainers_weights(run)
        # the broadcast group was re-formed with it: the next pushes (deltas) reach both engines
        more = run.train(steps=3)
        assert [m["sync/kind"] for m in more] == ["delta"] * 3
        _on_the_trainers_weights(run)
        assert loop.run(policy.rollouts[1].statistics())["num_queued"] > 0  # it generates
        assert dead_pid not in {p.pid for p in multiprocessing.active_children()}  # let go of, not kept
        assert set(policy.rollout_counts) == {"rollout-0", "rollout-1", "rollout-2"}
        _assert_nothing_lost(run, stopped=True)


def _one_actor_run(schedule: str, tmp_path: pathlib.Path) -> Any:
    """The default job with one rollout actor in its own process, one step taken."""
    run = launch(ROOT / "fully_async.yaml", *SHORT, *PROCESS, f"policy.type={schedule}", f"run.output_dir={tmp_path}")
    try:
        run.train(steps=1)
    except BaseException:
        run.close()
        raise
    return run


def _kill(handle: Any) -> None:
    os.kill(loop.run(handle.ping()), signal.SIGKILL)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.timeout(180)
def test_the_last_rollout_actor_killed_is_replaced_at_once_and_the_run_goes_on(schedule, tmp_path):
    with _one_actor_run(schedule, tmp_path) as run:
        policy = run.policy
        _kill(policy.rollouts[0])
        # the trainer waits for a batch only a replacement can make: it joins without a step's push
        records = run.train(steps=4)
        assert [m["step"] for m in records] == [2, 3, 4, 5]
        assert [h.name for h in policy.rollouts] == ["rollout-1"]
        assert records[-1]["lost_rollout_actors"] == records[-1]["respawned_rollout_actors"] == 1
        _on_the_trainers_weights(run)
        _assert_nothing_lost(run, stopped=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.timeout(120)
def test_a_replacement_that_cannot_be_set_up_for_the_last_actor_stops_the_run_in_one_line(schedule, tmp_path):
    with _one_actor_run(schedule, tmp_path) as run:
        policy = run.policy

        async def cannot(dead: Any) -> Any:
            raise OSError("injected: no room for a new actor")

        policy.respawn_rollout = cannot
        _kill(policy.rollouts[0])
        with pytest.raises(ActorLostError, match=r"^every rollout actor died \(rollout-0: .*exit code -9.*; the "
                                                 r"replacement of rollout-0: injected: no room") as info:
            run.train(steps=5)
        assert "\n" not in str(info.value)
        assert policy.rollouts == [] and policy.num_respawns == 1
        _assert_nothing_lost(run)


# -- a weight push fails half way ----------------------------------------------------------------------


def _fail_after_the_first_engine_applied(policy: Any, calls: list[int]) -> Any:
    """``swap_weights`` of the second engine: waits until the first engine holds the
    update's version, then raises (a link that broke half way through a push)."""
    first = policy.rollouts[0]

    async def swap_weights(handle: Any, in_flight: str = "abort", asleep: bool = False) -> Any:
        target = handle.manifest.version
        calls.append(target)
        for _ in range(500):
            if await first.get_version() == target:
                break
            await asyncio.sleep(0.01)
        raise ConnectionError(f"injected: the link to rollout-1 broke after rollout-0 applied version {target}")

    return swap_weights


def test_a_weight_push_that_fails_half_way_leaves_the_engines_on_the_old_version_and_training_goes_on(tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, "rollout.num_actors=2", f"run.output_dir={tmp_path}")
    with run:
        policy = run.policy
        run.train(steps=1)
        second = policy.rollouts[1].actor  # local runtime: the actor object itself
        calls: list[int] = []
        second.swap_weights = _fail_after_the_first_engine_applied(policy, calls)
        (failed,) = run.train(steps=1)
        assert calls == [2, 2]  # the push, and its one full retry
        assert failed["sync/failed"] == 1 and "injected" in failed["sync/error"]
        assert failed["failed_pushes"] == 1
        # the first engine was put back: every engine on the old version, none half way
        assert [loop.run(h.get_version()) for h in policy.rollouts] == [1, 1]
        assert loop.run(policy.trainer.get_version()) == 2

        del second.swap_weights  # the link is back
        records = run.train(steps=2)
        assert [m["sync/version"] for m in records] == [3, 4] and all("sync/failed" not in m for m in records)
        assert [loop.run(h.get_version()) for h in policy.rollouts] == [4, 4]
        want = loop.run(policy.trainer.weights_digest(run.cfg.rollout.engine.dtype))
        assert all(loop.run(h.weights_digest()) == want for h in policy.rollouts)
        _assert_nothing_lost(run)


def test_weight_pushes_that_keep_failing_stop_the_run_with_the_last_error(tmp_path):
    from policies.base import MAX_FAILED_PUSHES
    from sync import SyncFailed

    run = launch(ROOT / "fully_async.yaml", *SHORT, "rollout.num_actors=2", f"run.output_dir={tmp_path}")
    with run:
        policy = run.policy
        run.train(steps=1)
        calls: list[int] = []
        policy.rollouts[1].actor.swap_weights = _fail_after_the_first_engine_applied(policy, calls)
        with pytest.raises(SyncFailed, match="injected"):
            run.train(steps=MAX_FAILED_PUSHES + 2)
        assert policy.num_failed_pushes == MAX_FAILED_PUSHES and policy.step == 1 + MAX_FAILED_PUSHES
        assert [loop.run(h.get_version()) for h in policy.rollouts] == [1, 1]
        _assert_nothing_lost(run)


# -- a user reward hangs -------------------------------------------------------------------------------

_hangs = itertools.count()
HANG_ANSWER = "9 8"


def reward_that_hangs(text: str, answer: str) -> float:
    """A user reward (``task.kwargs.reward=tests.test_faults:reward_that_hangs``)
    that hangs for a second the first time it scores a response to the prompt
    whose answer is ``HANG_ANSWER``."""
    if answer == HANG_ANSWER and next(_hangs) == 0:
        time.sleep(1.0)
    return float(text.strip() == answer.strip())


@pytest.mark.timeout(60)
def test_a_user_reward_that_hangs_is_timed_out_counted_in_the_metrics_and_the_run_goes_on(tmp_path):
    global _hangs
    _hangs = itertools.count()  # the function runs here (local runtime): it hangs once in this test
    data = tmp_path / "digits.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(d), "answer": " ".join(reversed(d))}) + "\n"
                            for d in ("89", "123")))
    run = launch(ROOT / "fully_async.yaml", *SHORT, "task.type=text_dataset", f"task.kwargs.path={data}",
                 "task.kwargs.chat_template=false", "task.kwargs.reward=tests.test_faults:reward_that_hangs",
                 "policy.reward_timeout_s=0.2", f"run.output_dir={tmp_path}")
    with run:
        t0 = time.perf_counter()
        records = run.train(steps=4)
        assert time.perf_counter() - t0 < 40
        # the one hung call is the one timed out (its group-mates scored after it are not charged for its
        # time) and its group is dropped whole, each sample under its reason; the actor's count is the metrics'
        n = run.cfg.rollout.n
        assert records[-1]["dropped"] == {"reward_timeout": 1, "group_incomplete": n - 1}
        assert [loop.run(h.statistics())["num_reward_timeouts"] for h in run.policy.rollouts] == [1]
        _assert_nothing_lost(run)


# -- the trainer dies mid-step -------------------------------------------------------------------------


class StallingLoss:
    """The run's loss, except that once the file ``go`` exists its next call
    creates ``marker`` and stalls for a minute: a trainer step to kill the
    trainer in (pickled by reference into the trainer's process)."""

    def __init__(self, inner: Any, go: str, marker: str) -> None:
        self.inner, self.go, self.marker = inner, go, marker

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if os.path.exists(self.go) and not os.path.exists(self.marker):
            pathlib.Path(self.marker).touch()
            time.sleep(60)
        return self.inner(*args, **kwargs)


@pytest.mark.timeout(120)
def test_a_trainer_killed_mid_step_returns_its_batch_to_the_queue_and_stops_the_run_in_one_line(
        tmp_path, monkeypatch):
    import policies.losses

    go, marker = tmp_path / "go", tmp_path / "in-step"
    real = policies.losses.make_loss_from_config
    monkeypatch.setattr(policies.losses, "make_loss_from_config",
                        lambda trainer: StallingLoss(real(trainer), str(go), str(marker)))
    run = launch(ROOT / "fully_async.yaml", *SHORT, *PROCESS, f"run.output_dir={tmp_path / 'runs'}")
    with run:
        run.train(steps=1)
        pid = loop.run(run.policy.trainer.ping())
        batch = run.policy.batch_request().batch_size

        def kill_in_step() -> None:
            for _ in range(6000):
                if marker.exists():
                    os.kill(pid, signal.SIGKILL)
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_in_step, daemon=True)
        killer.start()
        go.touch()
        t0 = time.perf_counter()
        with pytest.raises(ActorLostError, match=rf"^the trainer died during step 2 \(.*exit code -9\)\); the {batch} "
                                                 r"samples it had leased are back in the queue") as info:
            run.train(steps=3)
        assert time.perf_counter() - t0 < 60 and "\n" not in str(info.value)
        killer.join(1)
        s = loop.run(run.queue.statistics_async())
        trainer = s.consumers["trainer"]
        assert (s.in_flight, trainer.in_flight, trainer.expired, trainer.delivered) == (0, 0, batch, batch)
        assert s.pending >= batch
        assert run.policy.trained == batch and run.policy.step == 1
        _assert_nothing_lost(run)


# -- the accounting check itself -----------------------------------------------------------------------


class _FakeQueue:
    """A queue that registered one group of 4 samples, all pending."""

    async def statistics_async(self) -> Any:
        from transfer_queue.wire import QueueStats

        return QueueStats(put=4, delivered=0, dropped=0, pending=4, in_flight=0, redelivered=0, capacity=64,
                          closed=False)


def _policy_with_one_group_reported(counts: RolloutCounts) -> Any:
    """A schedule (no actors) that admitted one group of 4 and got a report on it
    from rollout actor ``fake-rollout``, whose totals are ``counts``."""
    from types import SimpleNamespace

    from policies.baselines import SyncPolicy
    from policies.config import PolicyConfig, TaskConfig

    cfg = SimpleNamespace(run=SimpleNamespace(seed=0, log_samples_every=0),
                          rollout=SimpleNamespace(n=4, max_respawns=0), policy=PolicyConfig(), task=TaskConfig())
    policy = SyncPolicy(cfg, rollouts=[], trainer=None, queue=_FakeQueue(), task=None, weight_sync=None)
    policy.group_sent(GroupRequest(group_id="g0", prompt_ids=[1], n=4), "fake-rollout")
    policy.on_group(GroupReport(group_id="g0", num_samples=4, num_queued=4, counts=counts), "fake-rollout")
    return policy


def test_a_fake_rollout_report_that_under_reports_queued_fails_the_check_naming_the_actor_and_its_counts():
    """Negative control: the queue's own identity holds (4 put, 4 pending) and the
    report's group counts agree with it; only the actor's totals are one queued
    sample short. The check names the actor and its three numbers, on one line."""
    honest = _policy_with_one_group_reported(RolloutCounts(received=4, generated=4, queued=4))
    assert loop.run(honest.check_accounting()) == 4  # the control passes as it is

    fake = _policy_with_one_group_reported(RolloutCounts(received=4, generated=4, queued=3))  # a fake: one sample missing
    with pytest.raises(AccountingError, match=r"^rollout actor fake-rollout: generated=4 != queued=3 \+ "
                                              r"dropped before the queue=0$"):
        loop.run(fake.check_accounting())


def test_a_fake_rollout_actor_that_counts_samples_queued_the_queue_never_registered_fails_the_check():
    """Negative control of the cross-check: the actor's own identity holds (8 = 8 + 0)
    and so does the queue's, but it counts 8 queued where the queue registered 4
    (samples lost between an actor and the queue): only the actors' count shows it."""
    fake = _policy_with_one_group_reported(RolloutCounts(received=8, generated=8, queued=8))  # a fake: 4 never reached the queue
    with pytest.raises(AccountingError, match=r"^the queue registered put=4, 4 fewer than the 8 samples the rollout "
                                              r"actors counted queued: lost between the actors and the queue$"):
        loop.run(fake.check_accounting())
