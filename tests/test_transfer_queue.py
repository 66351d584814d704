"""TransferQueue, in-process deployment: readiness, samplers, staleness, backpressure,
leases, persistence, close semantics, and exactly-once delivery under concurrency.
Its parts below the client (storage unit, codec, coalescer, controller) are in
tests/test_transfer_queue_internals.py."""

from __future__ import annotations

import asyncio
import math

import msgspec
import numpy as np
import pytest
import pytest_asyncio

import loop
from contracts.sample import TOKEN_DTYPES, pack_tokens
from tests.helpers import assert_accounting, check_array_samples_round_trip, make_samples, run_producers_consumers
from transfer_queue import (
    EndOfStream,
    LeaseLost,
    QueueClosed,
    QueueEmpty,
    QueueFull,
    Sample,
    StorageUnitLost,
    TransferQueue,
    TransferQueueConfig,
)
from transfer_queue.codec import FULL_MASK
from transfer_queue.wire import SampleTags

pytestmark = pytest.mark.timeout(30)


@pytest_asyncio.fixture
async def tq() -> TransferQueue:
    q = await TransferQueue.create(TransferQueueConfig(capacity=64, num_storage_units=3, lease_s=math.inf))
    yield q
    await q.shutdown()


# ------------------------------------------------------------------------- data
@pytest.mark.asyncio
async def test_samples_round_trip_as_copies_and_columns_are_numpy(tq: TransferQueue) -> None:
    samples = make_samples(3, 2)
    for group in range(3):  # each put's samples go to one storage unit, round robin
        await tq.put(samples[2 * group : 2 * group + 2])
    copies = msgspec.msgpack.decode(msgspec.msgpack.encode(samples), type=list[Sample])
    expected = [msgspec.structs.asdict(s) for s in copies]
    samples[0].response_ids.append(99)  # the producer keeps its sample: the queue holds a copy
    batch = await tq.get("trainer", 6)
    got = batch.samples
    assert [msgspec.structs.asdict(g) for g in got] == expected
    assert batch.uids == [s.uid for s in samples] and batch.group_ids == [s.group_id for s in samples]
    assert sorted(len(u) for u in tq._d.units) == [2, 2, 2]  # sharded by global index % 3
    responses = batch.column("response_ids")
    assert {c.dtype for c in responses} == {np.dtype(np.int32)}
    assert {c.dtype for c in batch.column("rollout_logprobs")} == {np.dtype(np.float32)}
    assert [c.tolist() for c in responses] == [e["response_ids"] for e in expected]
    got[1].response_ids.clear()  # the consumer's samples are its own: a redelivery is intact
    await tq.nack(batch.batch_id)
    batch = await tq.get("trainer", 6)
    assert [msgspec.structs.asdict(g) for g in batch.samples] == expected
    await tq.ack(batch.batch_id)
    assert sum(len(u) for u in tq._d.units) == 0  # acked rows are freed


@pytest.mark.asyncio
async def test_array_samples_round_trip_as_read_only_arrays_beside_list_samples(tq: TransferQueue) -> None:
    await check_array_samples_round_trip(tq)


def test_pack_tokens_turns_a_finished_sample_into_arrays_with_the_same_values() -> None:
    (sample,) = make_samples(1, version=2)
    before = msgspec.structs.asdict(sample)
    assert pack_tokens(sample) is sample
    for name, dtype in TOKEN_DTYPES.items():
        value = getattr(sample, name)
        assert value.dtype == dtype and value.tolist() == before[name]
    assert (sample.min_version, sample.max_version) == (2, 2)



@pytest.mark.asyncio
async def test_sample_is_handed_out_only_once_its_requested_fields_are_ready(tq: TransferQueue) -> None:
    (full,) = make_samples(1)
    await tq.put_fields([Sample(uid=full.uid, group_id=full.group_id, prompt_ids=full.prompt_ids)], ["prompt_ids"])
    with pytest.raises(QueueEmpty):
        await tq.get_nowait("trainer", 1)
    waiter = asyncio.create_task(tq.get("trainer", 1))
    await tq.put_fields([full], ["response_ids", "rollout_logprobs", "token_versions"])
    await asyncio.sleep(0)
    assert not waiter.done()  # reward and the other scalars are still missing
    await tq.put_fields([full], ["reward", "finish_reason", "num_resumes", "meta", "created_s", "finished_s", "error"])
    batch = await waiter
    assert batch.samples == [full]
    assert tq.statistics().put == 1  # three writes, one sample


@pytest.mark.asyncio
async def test_get_with_a_field_subset_takes_partial_samples(tq: TransferQueue) -> None:
    (full,) = make_samples(1)
    await tq.put_fields([full], ["prompt_ids"])
    batch = await tq.get("scorer", 1, fields=["prompt_ids"])
    (s,) = batch.samples
    assert s.prompt_ids == full.prompt_ids and s.response_ids == []
    with pytest.raises(RuntimeError, match="leased"):
        await tq.put_fields([full], ["reward"])


@pytest.mark.asyncio
async def test_bad_requests_are_rejected_with_the_offending_value(tq: TransferQueue) -> None:
    with pytest.raises(ValueError, match="bogus"):
        await tq.get("trainer", 4, sampler="bogus")
    with pytest.raises(ValueError, match="group_size"):
        await tq.get("trainer", 6, sampler="grpo_group", group_size=4)
    with pytest.raises(ValueError, match="nope"):
        await tq.get("trainer", 1, fields=["nope"])
    with pytest.raises(ValueError, match="max_staleness"):
        await tq.get("trainer", 1, current_version=3)
    await tq.put(make_samples(1))
    with pytest.raises(ValueError, match="already in the queue"):
        await tq.put(make_samples(1))
    with pytest.raises(ValueError, match="capacity"):
        TransferQueueConfig(capacity=0)
    with pytest.raises(ValueError, match="deployment"):
        TransferQueueConfig(deployment="mpi")  # type: ignore[arg-type]


# --------------------------------------------------------------------- samplers
@pytest.mark.asyncio
async def test_grpo_sampler_hands_out_a_group_only_when_all_its_samples_are_ready(tq: TransferQueue) -> None:
    a, b = make_samples(1, 4, prefix="a"), make_samples(1, 4, prefix="b")
    await tq.put(a[:3] + b)
    batch = await tq.get("trainer", 4, sampler="grpo_group", group_size=4, timeout_s=0)
    assert batch.uids == [s.uid for s in b]  # group a is incomplete, b is whole
    with pytest.raises(QueueEmpty):
        await tq.get_nowait("trainer", 4, sampler="grpo_group", group_size=4)
    await tq.put(a[3:])
    batch = await tq.get("trainer", 4, sampler="grpo_group", group_size=4)
    assert set(batch.group_ids) == {a[0].group_id} and len(batch) == 4


@pytest.mark.asyncio
async def test_named_groups_are_handed_out_in_the_given_order_only_once_all_are_whole(tq: TransferQueue) -> None:
    a, b, c = (make_samples(1, 2, prefix=p) for p in "abc")
    await tq.put(c + b + a[:1])  # c and b complete first; a is still missing a member
    named = dict(sampler="grpo_group", group_size=2, group_ids=["ag0", "bg0"])
    with pytest.raises(QueueEmpty):
        await tq.get_nowait("trainer", 4, **named)
    waiting = asyncio.ensure_future(tq.get("trainer", 4, **named))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # b is whole, a is not: nothing is handed out
    await tq.put(a[1:])
    batch = await asyncio.wait_for(waiting, 5)
    assert batch.uids == [s.uid for s in a + b]  # in the given order, not arrival order
    assert [g for g, _, _ in await tq.pending_groups()] == ["cg0"]  # c waits for another batch
    with pytest.raises(ValueError, match="sampler='grpo_group'"):
        await tq.get("trainer", 2, group_ids=["cg0"], group_size=2)
    with pytest.raises(ValueError, match="distinct groups"):
        await tq.get("trainer", 2, sampler="grpo_group", group_size=2, group_ids=["cg0", "cg0"])


@pytest.mark.asyncio
async def test_a_named_group_the_queue_dropped_as_stale_raises_naming_it_instead_of_waiting(tq: TransferQueue) -> None:
    old, fresh = make_samples(1, 2, version=0, prefix="old"), make_samples(1, 2, version=3, prefix="new")
    await tq.put(old + fresh)
    assert await tq.drop_stale(current_version=3, max_staleness=1) == 2
    with pytest.raises(RuntimeError, match="'oldg0' was named for a batch but the queue dropped it as stale"):
        await tq.get("trainer", 4, sampler="grpo_group", group_size=2, group_ids=["newg0", "oldg0"], timeout_s=5)
    assert tq.statistics().dropped_by_reason == {"stale": 2}
    assert await tq.pending_groups() == [("newg0", 2, 3)]  # the fresh group is still there, unleased
    assert_accounting(tq.statistics())


@pytest.mark.asyncio
async def test_sequential_sampler_is_fifo(tq: TransferQueue) -> None:
    samples = make_samples(5)
    await tq.put(samples)
    first = await tq.get("trainer", 2)
    second = await tq.get("trainer", 3)
    assert first.uids + second.uids == [s.uid for s in samples]


# -------------------------------------------------------------------- staleness
@pytest.mark.asyncio
async def test_stale_samples_are_dropped_inside_get_and_counted(tq: TransferQueue) -> None:
    old, new = make_samples(3, version=1, prefix="old"), make_samples(2, version=4, prefix="new")
    await tq.put(old + new)
    batch = await tq.get("trainer", 2, current_version=5, max_staleness=2)
    assert batch.uids == [s.uid for s in new]
    assert batch.dropped == {"stale": 3}
    stats = tq.statistics()
    assert stats.dropped_by_reason == {"stale": 3}
    assert_accounting(stats)


@pytest.mark.asyncio
async def test_a_stale_member_drops_its_whole_group_and_late_members_on_arrival(tq: TransferQueue) -> None:
    group = make_samples(1, 4, version=3)
    group[1].token_versions = [0, 3, 3, 3]  # resumed across an update: min_version 0
    fresh = make_samples(1, 4, version=3, prefix="f")
    await tq.put(group[:3] + fresh)
    batch = await tq.get("trainer", 4, sampler="grpo_group", group_size=4, current_version=3, max_staleness=1)
    assert batch.uids == [s.uid for s in fresh]
    assert batch.dropped == {"stale": 1, "stale_group": 2}
    await tq.put(group[3:])  # the last member of the dead group arrives late
    stats = tq.statistics()
    assert stats.dropped_by_reason == {"stale": 1, "stale_group": 3}
    assert stats.pending == 0
    assert_accounting(stats)


@pytest.mark.asyncio
async def test_explicit_drop_is_counted_under_its_reason_and_all_or_nothing(tq: TransferQueue) -> None:
    samples = make_samples(3)
    await tq.put(samples)
    with pytest.raises(LookupError, match="nobody"):
        await tq.drop([samples[0].uid, "nobody"], "reward_error")
    assert await tq.drop([samples[0].uid], "reward_error") == 1
    with pytest.raises(ValueError, match="already dropped"):  # a late write cannot resurrect it
        await tq.put_fields([samples[0]], ["reward"])
    batch = await tq.get("trainer", 1)
    with pytest.raises(RuntimeError, match="leased"):
        await tq.drop(batch.uids, "reward_error")
    stats = tq.statistics()
    assert stats.dropped_by_reason == {"reward_error": 1}
    assert_accounting(stats)


# ------------------------------------------------------------------ backpressure
@pytest.mark.asyncio
async def test_put_waits_at_capacity_until_an_ack_frees_room() -> None:
    tq = await TransferQueue.create(TransferQueueConfig(capacity=4, num_storage_units=1))
    await tq.put(make_samples(4, prefix="a"))
    with pytest.raises(QueueFull):
        await tq.put(make_samples(1, prefix="b"), wait=False)
    blocked = asyncio.create_task(tq.put(make_samples(2, prefix="b")))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not blocked.done()
    batch = await tq.get("trainer", 2)
    await asyncio.sleep(0)
    assert not blocked.done()  # leased samples still hold their room
    await tq.ack(batch.batch_id)
    await blocked
    stats = tq.statistics()
    assert (stats.pending, stats.put) == (4, 6)
    with pytest.raises(ValueError, match="exceeds capacity"):
        await tq.put(make_samples(5, prefix="c"))


# ------------------------------------------------------------------------ leases
@pytest.mark.asyncio
async def test_batch_not_acked_within_its_lease_is_redelivered_to_another_consumer() -> None:
    tq = await TransferQueue.create(TransferQueueConfig(capacity=8, lease_s=0.05))
    await tq.put(make_samples(2))
    lost = await tq.get("trainer-0", 2)  # trainer-0 dies holding it
    again = await tq.get("trainer-1", 2)  # blocks until the lease runs out
    assert again.uids == lost.uids
    with pytest.raises(LeaseLost, match="expired"):
        await tq.ack(lost.batch_id)
    await tq.ack(again.batch_id)
    stats = tq.statistics()
    assert (stats.delivered, stats.redelivered) == (2, 2)
    assert stats.consumers["trainer-0"].expired == 2 and stats.consumers["trainer-1"].delivered == 2


@pytest.mark.asyncio
async def test_leases_expire_by_the_clock_and_can_be_extended() -> None:
    now = [0.0]
    tq = await TransferQueue.create(TransferQueueConfig(capacity=8, lease_s=1e6), clock=lambda: now[0])
    await tq.put(make_samples(4))
    a = await tq.get("t", 2)
    now[0] = 0.9e6
    b = await tq.get("t", 2)
    now[0] = 0.95e6
    await tq.extend_lease(a.batch_id)  # a's deadline 1.95e6, b's 1.9e6
    now[0] = 1.92e6
    assert await tq.expire_leases() == 2
    c = await tq.get("t", 2, timeout_s=0)
    assert c.uids == b.uids
    assert await tq.expire_leases(force=True) == 4
    with pytest.raises(LeaseLost):
        await tq.nack(a.batch_id)


@pytest.mark.asyncio
async def test_nack_returns_a_batch_at_once_in_arrival_order(tq: TransferQueue) -> None:
    samples = make_samples(4)
    await tq.put(samples)
    first = await tq.get("trainer", 2)
    await tq.nack(first.batch_id)
    again = await tq.get("trainer", 4, timeout_s=0)
    assert again.uids == [s.uid for s in samples]
    with pytest.raises(LeaseLost, match="nacked"):
        await tq.ack(first.batch_id)
    assert tq.statistics().redelivered == 2


# ------------------------------------------------------------------- persistence
@pytest.mark.asyncio
async def test_save_and_load_keep_pending_in_flight_partial_samples_and_counters(tq: TransferQueue, tmp_path) -> None:
    samples = make_samples(6)
    await tq.put(samples[:5])
    await tq.put(make_samples(2, prefix="v"), partition="val")
    await tq.put_fields([samples[5]], ["prompt_ids"])
    done = await tq.get("trainer", 1)
    await tq.ack(done.batch_id)
    await tq.drop([samples[1].uid], "reward_error")
    await tq.get("trainer", 1)  # in flight at save time: comes back ready
    before = tq.statistics()
    path = str(tmp_path / "queue.tq")
    await tq.save(path)

    tq2 = await TransferQueue.load(path, tq.cfg)
    after = tq2.statistics()
    assert (after.put, after.delivered, after.dropped_by_reason) == (before.put, before.delivered, before.dropped_by_reason)
    assert (after.pending, after.in_flight) == (before.pending + before.in_flight, 0)
    assert_accounting(after)
    batch = await tq2.get("trainer", 3, timeout_s=0)
    assert batch.samples == samples[2:5]
    with pytest.raises(QueueEmpty):  # the partial sample is still partial
        await tq2.get_nowait("trainer", 1)
    val = await tq2.get("eval", 2, partition="val", timeout_s=0)
    assert val.samples == make_samples(2, prefix="v")



@pytest.mark.asyncio
async def test_save_and_load_keep_array_samples_with_their_values(tq: TransferQueue, tmp_path) -> None:
    samples = make_samples(2, 2)
    await tq.put([pack_tokens(s) for s in make_samples(2, 2)])  # as rollout actors hand them over
    path = str(tmp_path / "queue.tq")
    await tq.save(path)
    tq2 = await TransferQueue.load(path, tq.cfg)
    batch = await tq2.get("trainer", 4, timeout_s=0)
    assert batch.samples == samples  # saved as lists: same values, lists after load
    await tq2.shutdown()


@pytest.mark.asyncio
async def test_a_lost_storage_unit_drops_its_samples_now_or_when_their_lease_comes_back() -> None:
    tq = await TransferQueue.create(TransferQueueConfig(capacity=64, num_storage_units=2, lease_s=math.inf))
    controller = tq._d.controller
    for prefix in "abcd":  # puts alternate units: a, c on unit 0; b, d on unit 1
        await tq.put(make_samples(1, 2, prefix=prefix))
    leased = await tq.get("trainer", 2)  # group a, on unit 0
    assert await controller.unit_lost(0) == 2  # group c now; group a is leased
    assert (await tq.statistics_async()).dropped_by_reason == {"storage_lost": 2}
    await tq.nack(leased.batch_id)  # its lease came back: dropped too
    stats = await tq.statistics_async()
    assert stats.dropped_by_reason == {"storage_lost": 4} and stats.pending == 4
    assert_accounting(stats)
    await tq.put(make_samples(1, 2, prefix="e"))  # new samples are placed on live units only
    batch = await tq.get("trainer", 6, timeout_s=0)
    assert sorted(batch.uids) == ["b0", "b1", "d0", "d1", "e0", "e1"]
    assert all(index % 2 == 1 for index in controller._table.by_index)
    assert await controller.unit_lost(0) == 0  # idempotent
    with pytest.raises(ValueError, match="unit in"):
        await controller.unit_lost(2)
    await tq.shutdown()


@pytest.mark.asyncio
async def test_a_replaced_storage_unit_takes_new_samples_and_its_lost_ones_stay_dropped() -> None:
    tq = await TransferQueue.create(TransferQueueConfig(capacity=64, num_storage_units=2, lease_s=math.inf))
    controller = tq._d.controller
    for prefix in "abc":  # a, c on unit 0 (slots 0-3); b on unit 1
        await tq.put(make_samples(1, 2, prefix=prefix))
    leased = await tq.get("trainer", 2)  # group a
    block = controller.allocate(0, 4)  # a Ray client's block on unit 0, handed out before the loss
    assert await controller.unit_lost(0, generation=0) == 2  # group c; group a when its lease comes back
    tq._d.units[0].clear()  # its rows went with it
    assert controller.unit_state(0) == (0, 8, False)  # every slot handed out so far is lost
    await tq.put(make_samples(1, 2, prefix="d"))  # unit 0 is down: unit 1
    assert controller.unit_replaced(0) == 1
    assert controller.unit_state(0) == (1, 8, True)
    assert await controller.unit_lost(0, generation=0) == 0  # a late report of the lost actor changes nothing
    assert controller.unit_state(0) == (1, 8, True)
    await tq.put(make_samples(1, 2, prefix="e"))  # round robin: unit 0 again, on the replacement
    assert [controller._table.by_uid[f"e{i}"].index for i in range(2)] == [16, 18]  # slots 8, 9 of unit 0
    tags = [SampleTags(uid="f0", group_id="f", mask=FULL_MASK)]
    with pytest.raises(StorageUnitLost, match="before its storage unit was lost") as stale:
        await controller.reserve("train", tags, True, indices=[block * 2], commit=True)
    assert stale.value.unit == 0
    await tq.nack(leased.batch_id)  # group a's lease came back: dropped
    stats = await tq.statistics_async()
    assert stats.dropped_by_reason == {"storage_lost": 4} and stats.pending == 6
    assert_accounting(stats)
    batch = await tq.get("trainer", 6, timeout_s=0)
    assert sorted(batch.uids) == ["b0", "b1", "d0", "d1", "e0", "e1"]  # e read from the replacement
    await tq.ack(batch.batch_id)
    assert await controller.unit_lost(0, generation=1) == 0  # the replacement died too: nothing of it pending
    assert controller.unit_state(0) == (1, 10, False)
    await tq.shutdown()

# ----------------------------------------------------------------------- close
@pytest.mark.asyncio
async def test_close_wakes_waiters_with_end_of_stream_and_put_raises_queue_closed() -> None:
    tq = await TransferQueue.create(TransferQueueConfig(capacity=4))
    await tq.put(make_samples(3))
    getter = asyncio.create_task(tq.get("trainer", 4))
    putter = asyncio.create_task(tq.put(make_samples(2, prefix="late")))  # over capacity: waits
    await asyncio.sleep(0)
    await tq.close()
    with pytest.raises(EndOfStream):
        await getter
    with pytest.raises(QueueClosed):
        await putter
    with pytest.raises(QueueClosed):
        await tq.put(make_samples(1, prefix="later"))
    batch = await tq.get("trainer", 3)  # what can still form a batch drains
    await tq.ack(batch.batch_id)
    with pytest.raises(EndOfStream):
        await tq.get("trainer", 1)
    assert tq.statistics().closed


@pytest.mark.asyncio
async def test_get_timeout_raises_timeout_error(tq: TransferQueue) -> None:
    with pytest.raises(TimeoutError):
        await tq.get("trainer", 1, timeout_s=0.01)


def test_the_sync_view_runs_each_call_on_the_process_loop(tmp_path) -> None:
    tq = TransferQueue.sync.create(TransferQueueConfig(capacity=8))
    tq.sync.put(make_samples(2))
    batch = tq.sync.get("notebook", 2)
    assert tq.sync.ack(batch.batch_id) == 2
    tq.sync.put(make_samples(1, prefix="x"))
    tq.sync.save(str(tmp_path / "q.tq"))
    tq2 = TransferQueue.sync.load(str(tmp_path / "q.tq"), tq.cfg)
    assert tq2.statistics().pending == 1
    tq.sync.close()
    with pytest.raises(QueueClosed):
        tq.sync.put(make_samples(1, prefix="y"))
    with pytest.raises(AttributeError, match="no async method 'statistics'"):  # already synchronous
        tq.sync.statistics()
    assert loop.get_loop() is loop.get_loop()


# ----------------------------------------------------------------- concurrency
@pytest.mark.asyncio
async def test_four_producers_two_consumers_deliver_every_sample_exactly_once() -> None:
    tq = await TransferQueue.create(TransferQueueConfig(capacity=32, num_storage_units=2))
    await run_producers_consumers(tq)
