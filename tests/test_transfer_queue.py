"""TransferQueue, in-process deployment: readiness, samplers, staleness, backpressure,
leases, persistence, close semantics, and exactly-once delivery under concurrency."""

from __future__ import annotations

import asyncio
import math

import msgspec
import numpy as np
import pytest
import pytest_asyncio

import loop
from transfer_queue import (
    EndOfStream,
    LeaseLost,
    QueueClosed,
    QueueEmpty,
    QueueFull,
    Sample,
    TransferQueue,
    TransferQueueConfig,
)
from transfer_queue.coalesce import PutCoalescer, ReserveRefused
from transfer_queue.codec import (
    ALL_FIELDS,
    FULL_MASK,
    decode_identities,
    decode_samples,
    encode_new_samples,
    encode_rows,
    fields_mask,
    frame_rows,
    sample_to_row,
    tags_of,
)
from contracts.sample import TOKEN_DTYPES, pack_tokens
from transfer_queue.storage import StorageUnit
from transfer_queue.wire import QueueStats

pytestmark = pytest.mark.timeout(30)


# ------------------------------------------------------------------ helpers (shared)
def make_samples(
    num_groups: int, group_size: int = 1, version: int = 0, prefix: str = "s", num_tokens: int = 4
) -> list[Sample]:
    """``num_groups`` GRPO groups of ``group_size`` samples, every token from ``version``."""
    out = []
    for g in range(num_groups):
        for k in range(group_size):
            i = g * group_size + k
            out.append(
                Sample(
                    uid=f"{prefix}{i}",
                    group_id=f"{prefix}g{g}",
                    prompt_ids=[1, 2, 3],
                    response_ids=list(range(i, i + num_tokens)),
                    rollout_logprobs=[-0.5] * num_tokens,
                    token_versions=[version] * num_tokens,
                    reward=float(k),
                    finish_reason="stop",
                    meta={"answer": str(i)},
                )
            )
    return out


def assert_accounting(stats: QueueStats) -> None:
    assert stats.dropped == sum(stats.dropped_by_reason.values())
    assert stats.put == stats.delivered + stats.dropped + stats.pending + stats.in_flight, stats


def with_arrays(samples: list[Sample]) -> list[Sample]:
    """The same samples holding numpy arrays as an engine hands them over (int64 ids,
    float64 log-probs: the queue stores int32 and float32)."""
    return [
        msgspec.structs.replace(
            s, prompt_ids=np.array(s.prompt_ids, np.int64), response_ids=np.array(s.response_ids, np.int64),
            rollout_logprobs=np.array(s.rollout_logprobs, np.float64), token_versions=np.array(s.token_versions, np.int64),
        )
        for s in samples
    ]  # fmt: skip


async def check_array_samples_round_trip(tq: TransferQueue) -> None:
    """Array samples come back as read-only arrays (int32 / float32) with their values, next to
    list samples in the same batch, with version tags from the arrays; bad arrays are refused."""
    lists = make_samples(2, 2, version=3)
    arrays = with_arrays(make_samples(2, 2, version=3, prefix="a", num_tokens=1000))
    arrays[0].response_ids[0] = 2**31 - 1  # the largest token id int32 holds
    await tq.put(lists[:2])
    await tq.put(arrays[:2])
    await tq.put(arrays[2:])
    await tq.put(lists[2:])
    batch = await tq.get("trainer", 8, sampler="grpo_group", group_size=2, current_version=4, max_staleness=1)
    assert batch.dropped == {}  # tags (min/max version) came from the arrays
    got = {s.uid: s for s in batch.samples}
    for want in arrays:
        s = got[want.uid]
        assert s.response_ids.dtype == np.int32 and s.rollout_logprobs.dtype == np.float32
        assert s.response_ids.tolist() == want.response_ids.tolist()
        assert s.rollout_logprobs.tolist() == want.rollout_logprobs.astype(np.float32).tolist()
        assert (s.min_version, s.max_version) == (3, 3) and s.reward == want.reward
        with pytest.raises(ValueError, match="read-only"):
            s.response_ids[0] = 0  # a redelivery must see what was put
    for want in lists:
        assert got[want.uid] == want
    columns = dict(zip(batch.uids, batch.column("response_ids")))
    assert all(columns[s.uid].tolist() == list(s.response_ids) for s in (*lists, *arrays))
    await tq.ack(batch.batch_id)
    bad = make_samples(1, prefix="bad")
    bad[0].response_ids = np.zeros((2, 2), np.int32)
    with pytest.raises(ValueError, match="'response_ids' must be a list or a 1-D array"):
        await tq.put(bad)
    assert_accounting(await tq.statistics_async())


async def run_producers_consumers(
    tq: TransferQueue, num_producers: int = 4, num_consumers: int = 2, per_producer: int = 64, batch_size: int = 8
) -> None:
    """4 producers x 2 consumers; every uid put is delivered exactly once or dropped with a reason."""
    delivered: list[str] = []
    received = [0]

    async def produce(p: int) -> None:
        samples = make_samples(per_producer // 4, 4, prefix=f"p{p}-")
        for i in range(0, len(samples), 4):
            await tq.put(samples[i : i + 4])

    async def consume(c: int) -> None:
        while True:
            try:
                batch = await tq.get(f"trainer-{c}", batch_size, sampler="grpo_group", group_size=4)
            except EndOfStream:
                return
            received[0] += 1
            if received[0] % 3 == 0:
                await tq.nack(batch.batch_id)  # exercise redelivery under load
            else:
                delivered.extend(s.uid for s in batch.samples)
                await tq.ack(batch.batch_id)

    consumers = [asyncio.create_task(consume(c)) for c in range(num_consumers)]
    await asyncio.gather(*(produce(p) for p in range(num_producers)))
    await tq.drop([], "unused")  # a no-op drop is allowed
    await tq.close()
    await asyncio.gather(*consumers)
    stats = await tq.statistics_async()
    assert_accounting(stats)
    assert len(delivered) == len(set(delivered)), "a sample was delivered twice"
    assert stats.put == num_producers * per_producer
    assert stats.delivered == len(delivered) == stats.put - stats.dropped - stats.pending
    assert stats.pending == 0 and stats.in_flight == 0


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


def test_storage_unit_keeps_encoded_rows_unparsed_and_merges_field_writes() -> None:
    unit = StorageUnit(0)
    samples = make_samples(2, 2)
    prompts = [sample_to_row(s, ["prompt_ids"]) for s in samples]
    rest = [sample_to_row(s, [f for f in ALL_FIELDS if f != "prompt_ids"]) for s in samples]
    unit.put_encoded([0, 2, 4, 6], encode_rows(prompts))
    unit.put_encoded([0, 2, 4, 6], encode_rows(rest))  # a later write adds the other fields
    assert {type(v) for row in unit._rows.values() for v in row.values()} == {msgspec.Raw}
    assert decode_samples(unit.get_encoded([6, 0, 2, 4], None), FULL_MASK) == [samples[3], *samples[:3]]
    fields = ("response_ids", "reward")
    partial = decode_samples(unit.get_encoded([2], fields), fields_mask(fields))
    assert partial == [Sample(uid=samples[1].uid, group_id=samples[1].group_id, prompt_ids=[],
                              response_ids=samples[1].response_ids, reward=samples[1].reward)]  # fmt: skip
    assert decode_identities(unit.get_encoded([4, 0], fields)) == [(samples[2].uid, samples[2].group_id),
                                                                   (samples[0].uid, samples[0].group_id)]  # fmt: skip
    with pytest.raises(LookupError, match="no row"):
        unit.get_encoded([8], None)


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
    assert all(index % 2 == 1 for index in controller._by_index)
    assert await controller.unit_lost(0) == 0  # idempotent
    with pytest.raises(ValueError, match="unit in"):
        await controller.unit_lost(2)
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


def test_sync_twins_run_on_the_process_loop(tmp_path) -> None:
    tq = TransferQueue.create_sync(TransferQueueConfig(capacity=8))
    tq.put_sync(make_samples(2))
    batch = tq.get_sync("notebook", 2)
    assert tq.ack_sync(batch.batch_id) == 2
    tq.put_sync(make_samples(1, prefix="x"))
    tq.save_sync(str(tmp_path / "q.tq"))
    tq2 = TransferQueue.load_sync(str(tmp_path / "q.tq"), tq.cfg)
    assert tq2.statistics().pending == 1
    tq.close_sync()
    with pytest.raises(QueueClosed):
        tq.put_sync(make_samples(1, prefix="y"))
    assert loop.get_loop() is loop.get_loop()


# ----------------------------------------------------------------- concurrency
@pytest.mark.asyncio
async def test_four_producers_two_consumers_deliver_every_sample_exactly_once() -> None:
    tq = await TransferQueue.create(TransferQueueConfig(capacity=32, num_storage_units=2))
    await run_producers_consumers(tq)


@pytest.mark.asyncio
async def test_puts_issued_in_one_tick_share_one_write_and_keep_their_own_errors() -> None:
    writes: list[list[str]] = []
    release = asyncio.Event()

    async def write(key, rows, tags) -> None:
        writes.append(list(rows))
        if "bad" in rows:
            raise ReserveRefused(ValueError("bad row"))
        await release.wait()

    coalescer = PutCoalescer(write)
    first = [asyncio.create_task(coalescer.put("k", [f"a{i}"], [None])) for i in range(3)]
    await asyncio.sleep(0.01)
    assert writes == [["a0", "a1", "a2"]]  # one write for the three puts of that tick
    behind = [asyncio.create_task(coalescer.put("k", [r], [None])) for r in ("b", "bad")]
    release.set()
    await asyncio.gather(*first)
    assert await asyncio.gather(*behind, return_exceptions=True) == [None, ANY_VALUE_ERROR]
    # queued behind the first write, merged, refused together, then retried one by one
    assert writes[1:] == [["b", "bad"], ["b"], ["bad"]]


class _AnyValueError:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, ValueError) and str(other) == "bad row"


ANY_VALUE_ERROR = _AnyValueError()


def test_new_samples_encode_straight_into_bodies_that_frame_into_one_write() -> None:
    samples = make_samples(40, 2)  # 80 rows: a 3-byte array header once framed
    samples[5].response_ids = np.array(samples[5].response_ids)  # an engine's array takes the row path
    parts = [samples[:1], samples[1:17], samples[17:]]  # 1, 16 (a 3-byte header) and 63 rows
    encoded = [encode_new_samples(p) for p in parts]
    framed = frame_rows(len(samples), [body for body, _ in encoded])
    samples[5].response_ids = samples[5].response_ids.tolist()
    decoded = decode_samples(framed, FULL_MASK)
    assert decoded[5].response_ids.dtype == np.int32  # an array comes back as one (as int32)
    decoded[5].response_ids = decoded[5].response_ids.tolist()
    assert decoded == samples
    assert [t for _, tags in encoded for t in tags] == [tags_of(sample_to_row(s, ALL_FIELDS), FULL_MASK) for s in samples]
    assert decode_samples(frame_rows(0, []), FULL_MASK) == []


@pytest.mark.asyncio
async def test_controller_places_new_samples_at_allocated_indices_that_never_collide() -> None:
    from transfer_queue.controller import Controller
    from transfer_queue.errors import QueueFull as Full

    controller = Controller(TransferQueueConfig(capacity=8, num_storage_units=2))
    first = controller.allocate(1, 4)
    rows = [sample_to_row(s, ALL_FIELDS) for s in make_samples(2, 2)]
    tags = [tags_of(r, FULL_MASK) for r in rows]
    mine = [(first + k) * 2 + 1 for k in range(4)]  # slots of unit 1: index % 2 == 1
    assert await controller.reserve("train", tags, True, indices=mine, commit=True) == mine
    assert controller.statistics().partitions["train"].ready == 4  # committed at once
    others = [sample_to_row(s, ALL_FIELDS) for s in make_samples(2, 2, prefix="o")]
    placed = await controller.reserve("train", [tags_of(r, FULL_MASK) for r in others], True)
    assert not set(placed) & set(mine)  # the round-robin path skips the allocated block
    with pytest.raises(Full):  # capacity still holds for placed puts
        late = [tags_of(sample_to_row(s, ALL_FIELDS), FULL_MASK) for s in make_samples(1, prefix="x")]
        await controller.reserve("train", late, True, wait=False, indices=[controller.allocate(0, 1) * 2], commit=True)
    with pytest.raises(ValueError, match="num_slots"):
        controller.allocate(0, 0)
