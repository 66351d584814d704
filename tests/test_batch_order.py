"""policy.batch_order: fully-async trains the groups it admitted, oldest first
(``admission``), or the first to finish generating (``completion``: groups with a
long sample go later). The rollout actors, trainer and weight push here are fakes
over a real in-process TransferQueue; a group's "length" is when it finishes."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

import loop
from actors.trainer import TrainerActor
from contracts.rollout import GroupReport, GroupRequest, RolloutCounts
from contracts.sample import Sample, batch_stats
from contracts.training import BatchRequest, StepReport
from policies.config import PolicyConfig, TaskConfig
from policies.fully_async import FullyAsyncPolicy
from transfer_queue import TransferQueue, TransferQueueConfig

pytestmark = pytest.mark.timeout(60)

N = 2  # samples a group
BATCH_PROMPTS = 2  # groups a step
LONG_EVERY = 3  # groups g0, g3, g6, ... have a long sample: they finish after two groups admitted after them


def _index(group_id: str) -> int:
    return int(group_id.removeprefix("g"))


class FakeWorld:
    """What the fake rollout actors share: which groups finished, in order."""

    def __init__(self) -> None:
        self.finished: list[int] = []
        self.changed = asyncio.Condition()

    async def finish(self, i: int) -> None:
        async with self.changed:
            self.finished.append(i)
            self.changed.notify_all()

    async def after_two_later_groups(self, i: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: sum(j > i for j in self.finished) >= 2)
        await asyncio.sleep(0.02)  # and a little later still: a trainer waiting for any two groups takes those


class FakeRollout:
    """A fake rollout actor: a long group (every LONG_EVERY-th) finishes only after two groups
    admitted after it did; every group is queued whole, its tokens of the fake engine's version.
    Long groups score [0, 1] (an advantage to learn from), short ones [1, 1] (none)."""

    def __init__(self, name: str, queue: TransferQueue, world: FakeWorld) -> None:
        self.name, self.queue, self.world = name, queue, world
        self.version = 0
        self.generated = self.queued = 0

    async def generate_group(self, group: GroupRequest) -> GroupReport:
        i, version = _index(group.group_id), self.version
        long = i % LONG_EVERY == 0
        if long:
            await self.world.after_two_later_groups(i)
        else:
            await asyncio.sleep(0.001)
        samples = [Sample(uid=f"{group.group_id}-{k}", group_id=group.group_id, prompt_ids=list(group.prompt_ids),
                          response_ids=[5] * (8 if long else 2), rollout_logprobs=[-0.5] * (8 if long else 2),
                          token_versions=[version] * (8 if long else 2),
                          reward=float(k) if long else 1.0, finish_reason="stop") for k in range(group.n)]
        await self.queue.put(samples)
        self.generated += group.n
        self.queued += group.n
        await self.world.finish(i)
        return GroupReport(group_id=group.group_id, num_samples=group.n, num_queued=group.n, num_scored=group.n,
                           counts=RolloutCounts(received=self.generated, generated=self.generated, queued=self.queued),
                           min_version=min(s.min_version for s in samples))


class FakeTrainer:
    """A fake trainer: takes its batch as the trainer actor does (``TrainerActor._get_batch``),
    records its groups, acks it and moves its version on."""

    def __init__(self, queue: TransferQueue) -> None:
        self.queue = queue
        self.version = 0
        self.steps: list[list[str]] = []  # the groups of each step, in batch order
        self.before_get: Any = None  # a coroutine function of the request, awaited once before the next get
        self.num_calls = 0

    async def train_step(self, request: BatchRequest) -> StepReport:
        self.num_calls += 1
        if self.before_get is not None:
            before, self.before_get = self.before_get, None
            await before(request)
        batch = await TrainerActor._get_batch(self, request)  # type: ignore[arg-type]
        samples = batch.samples
        groups = list(dict.fromkeys(s.group_id for s in samples))
        self.steps.append(groups)
        await self.queue.ack(batch.batch_id)
        self.version += 1
        return StepReport(version=self.version, num_samples=len(samples), num_tokens=0, wait_s=0.0, train_s=0.0,
                          dropped=dict(batch.dropped), metrics=batch_stats(samples, request.current_version))


async def fake_push(engines: list[FakeRollout], trainer: FakeTrainer, released: Any = None) -> dict[str, Any]:
    for e in engines:
        e.version = trainer.version
    if released is not None:
        released.set()
    return {"version": trainer.version}


class FakeTask:
    def sample_prompts(self, rng: Any, num: int) -> list[Any]:
        return [SimpleNamespace(prompt_ids=[1, 2, 3], meta={}) for _ in range(num)]


def _cfg(batch_order: str, max_staleness: int = 2) -> Any:
    policy = PolicyConfig(batch_order=batch_order, max_staleness=max_staleness,  # type: ignore[arg-type]
                          overlap_push=False, staleness_threshold=1.0)
    return SimpleNamespace(run=SimpleNamespace(seed=0, log_samples_every=0),
                           rollout=SimpleNamespace(n=N, max_respawns=0), policy=policy, task=TaskConfig(), batch_size=BATCH_PROMPTS * N)


async def _policy(batch_order: str, queue: TransferQueue, max_staleness: int = 2) -> tuple[FullyAsyncPolicy, Any]:
    world = FakeWorld()
    rollouts = [FakeRollout("fake-rollout-0", queue, world), FakeRollout("fake-rollout-1", queue, world)]
    trainer = FakeTrainer(queue)
    policy = FullyAsyncPolicy(_cfg(batch_order, max_staleness), rollouts=rollouts, trainer=trainer, queue=queue,
                              task=FakeTask(), weight_sync=fake_push)
    return policy, trainer


async def _train(batch_order: str, num_steps: int, max_staleness: int = 2) -> tuple[list[list[str]], list[dict]]:
    queue = await TransferQueue.create(TransferQueueConfig(capacity=256, lease_s=math.inf))
    policy, trainer = await _policy(batch_order, queue, max_staleness)
    try:
        records = await policy.train(num_steps)  # checks produced == trained + dropped + pending every step
    finally:
        await policy.close()
        await queue.shutdown()
    return trainer.steps, records


def _step_of(steps: list[list[str]]) -> dict[int, int]:
    return {_index(g): s for s, groups in enumerate(steps) for g in groups}


def test_admission_order_trains_each_step_the_oldest_groups_admitted_so_long_groups_are_not_delayed():
    steps, records = loop.run(_train("admission", 8, max_staleness=1))
    k = BATCH_PROMPTS
    assert steps == [[f"g{i}" for i in range(s * k, (s + 1) * k)] for s in range(8)]  # admission order, exactly
    at = _step_of(steps)
    longs = [i for i in at if i % LONG_EVERY == 0 and i + 1 in at]
    assert longs and all(at[i] <= at[i + 1] for i in longs)  # never after the short group admitted next
    assert all(not m["dropped"] for m in records)  # none went stale waiting
    assert all(m["produced"] == m["trained"] + m["pending"] for m in records)
    assert [m["zero_adv_group_share"] for m in records[:3]] == [0.5, 0.5, 1.0]  # g0 g1 | g2 g3 | g4 g5


def test_completion_order_trains_long_groups_later_than_the_short_ones_admitted_with_them():
    """The bias ``admission`` removes: so this fails if the order made no difference."""
    steps, records = loop.run(_train("completion", 8, max_staleness=1))
    at = _step_of(steps)
    longs = [i for i in range(0, 16, LONG_EVERY)]
    later = [i for i in longs if i + 1 in at and at.get(i, math.inf) > at[i + 1]]
    assert later == [i for i in longs if i + 1 in at]  # every long group: after the short group admitted next
    assert steps[0] == ["g1", "g2"]


@pytest.mark.parametrize("saved_order", [True, False])
def test_a_resumed_policy_trains_the_restored_queues_groups_first_in_the_saved_order_else_as_they_arrived(
        saved_order):
    """The checkpoint keeps the admission order of the groups queued; an older one has no
    ``group_order``: then the queue's groups go first as they arrived."""

    async def scenario() -> tuple[list[str], list[list[str]], list[str]]:
        queue = await TransferQueue.create(TransferQueueConfig(capacity=256, lease_s=math.inf))
        before, _ = await _policy("admission", queue)
        try:
            await before.train(1)  # g0 g1; then g2, g4, g5 finish before g3 (long)
            while before.in_flight:  # let rollout settle: every admitted group reported
                await asyncio.sleep(0.01)
            await before.close()
            state = before.state_dict(await queue.statistics_async())
            saved = [g for g, _ in (state["group_order"] if saved_order else state.pop("group_order"))]
            queued = [g for g, _, _ in await queue.pending_groups()]
            after, trainer = await _policy("admission", queue)
            after.load_state_dict(msgspec.json.decode(msgspec.json.encode(state)))  # through JSON, as saved
            await after.train(len(queued) // BATCH_PROMPTS)
            await after.close()
        finally:
            await queue.shutdown()
        return queued, trainer.steps, saved

    queued, steps, saved = loop.run(scenario())
    assert (queued, saved) == (["g2", "g4", "g5", "g3"], ["g2", "g3", "g4", "g5"])  # the two orders differ
    assert steps == ([["g2", "g3"], ["g4", "g5"]] if saved_order else [["g2", "g4"], ["g5", "g3"]])


@pytest.mark.parametrize("when", ["between steps", "at the get"])
def test_groups_lost_with_a_storage_unit_are_skipped_and_the_run_goes_on(when):
    """A storage unit dies (its node did) with some of the queued groups the policy
    names next, between steps or after it named them: the queue drops them (counted:
    storage_lost), and the steps train the next oldest groups instead of the gone ones."""

    async def scenario() -> tuple[list[list[str]], list[dict], list[str]]:
        queue = await TransferQueue.create(TransferQueueConfig(capacity=256, num_storage_units=2, lease_s=math.inf))
        policy, trainer = await _policy("admission", queue)
        controller = queue._d.controller
        lose = controller.unit_lost
        try:
            records = await policy.train(1)
            while policy.in_flight:  # every admitted group reported: queued, waiting for its turn
                await asyncio.sleep(0.01)
            queued = [g for g, _, _ in await queue.pending_groups()]
            if when == "between steps":
                await lose(0)  # the unit of every other put
            else:
                def unit_of(request: BatchRequest) -> int:  # the one holding the step's first group
                    return controller._table.by_uid[f"{request.group_ids[0]}-0"].index % 2

                trainer.before_get = lambda request: lose(unit_of(request))  # the get refuses it: picked again
            records += await policy.train(3)  # checks produced == trained + dropped + pending every step
            gone = sorted(set(queued) - {g for s in trainer.steps for g in s} - {g for g, _, _ in
                                                                               await queue.pending_groups()})
        finally:
            await policy.close()
            await queue.shutdown()
        assert trainer.num_calls == len(trainer.steps) + (when == "at the get")  # one get refused, then
        return trainer.steps, records, gone

    steps, records, gone = loop.run(scenario())
    trained = [g for s in steps for g in s]
    assert gone and not set(gone) & set(trained)
    assert records[-1]["dropped"] == {"storage_lost": len(gone) * N}
    assert trained == sorted(trained, key=_index)  # still the oldest admitted, in order
