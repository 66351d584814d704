"""TransferQueue, Ray deployment: same client API, controller and storage units as actors."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest

from tests.helpers import assert_accounting, check_array_samples_round_trip, make_samples, run_producers_consumers
from transfer_queue import (
    EndOfStream,
    QueueClosed,
    QueueEmpty,
    QueueFull,
    StorageUnitLost,
    TransferQueue,
    TransferQueueConfig,
)

ray = pytest.importorskip("ray")
from transfer_queue import ray_deploy  # noqa: E402 - Ray must import first

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


def _cfg(**kw) -> TransferQueueConfig:
    return TransferQueueConfig(deployment="ray", **{"capacity": 32, "num_storage_units": 2, **kw})


@pytest.mark.asyncio
async def test_ray_deployment_refuses_to_start_ray_itself() -> None:
    if ray.is_initialized():
        pytest.skip("another test left Ray running")
    with pytest.raises(RuntimeError, match="ray.init"):
        await TransferQueue.create(_cfg())


@pytest.mark.asyncio
async def test_ray_samples_round_trip_through_storage_actors_and_the_client_pickles(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg())
    samples = make_samples(4, 2)
    await tq.put(samples[:4])
    await tq.put(samples[4:])  # a put returns once its rows are stored and committed
    rows = await asyncio.gather(*(u.num_rows.remote() for u in tq._d.units))
    assert sorted(rows) == [4, 4]
    batch = await tq.get("trainer", 8, sampler="grpo_group", group_size=2)
    assert batch.samples == samples
    await tq.ack(batch.batch_id)
    stats = await tq.statistics_async()
    assert (stats.put, stats.delivered) == (8, 8)

    @ray.remote(num_cpus=0)
    def produce(queue: TransferQueue) -> int:  # the client pickles into another process
        from tests.helpers import make_samples

        queue.sync.put(make_samples(3, prefix="remote"))
        return queue.statistics().put

    assert await produce.remote(tq) == 8 + 3
    batch = await tq.get("trainer", 3)
    assert batch.uids == ["remote0", "remote1", "remote2"]
    await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_actors_listen_in_the_configured_port_range(ray_cluster) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        first = min(probe.getsockname()[1], 65535 - 40)
    tq = await TransferQueue.create(_cfg(ports=(first, first + 40)))
    try:
        ports = [port for _, port in tq._d._addresses]  # the controller's, then each storage unit's
        assert len(set(ports)) == 3 and all(first <= p <= first + 40 for p in ports)
        await tq.put(make_samples(2))
        assert (await tq.get("trainer", 2)).uids == ["s0", "s1"]
    finally:
        await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_errors_surface_as_the_queue_errors(ray_cluster, tmp_path) -> None:
    tq = await TransferQueue.create(_cfg(capacity=4, num_storage_units=1))
    await tq.put(make_samples(2, 2, version=0))
    with pytest.raises(QueueFull):
        await tq.put(make_samples(1, prefix="x"), wait=False)
    with pytest.raises(QueueEmpty):
        await tq.get_nowait("trainer", 4, current_version=2, max_staleness=1)
    assert tq.statistics().dropped_by_reason == {"stale": 4}
    await tq.put(make_samples(1, 2, version=2, prefix="n"))
    path = str(tmp_path / "q.tq")
    await tq.save(path)
    await tq.shutdown()
    tq2 = await TransferQueue.load(path, tq.cfg)
    assert_accounting(await tq2.statistics_async())
    getter = asyncio.create_task(tq2.get("trainer", 4))
    await tq2.close()
    with pytest.raises(EndOfStream):
        await getter
    with pytest.raises(QueueClosed):
        await tq2.put(make_samples(1, prefix="late"))
    batch = await tq2.get("trainer", 2, timeout_s=0)
    assert batch.samples == make_samples(1, 2, version=2, prefix="n")
    await tq2.shutdown()


@pytest.mark.asyncio
async def test_ray_four_producers_two_consumers_deliver_every_sample_exactly_once(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg())
    await run_producers_consumers(tq)
    await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_large_puts_and_reads_come_back_whole(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg(num_storage_units=1))
    samples = make_samples(2, 2, num_tokens=20_000)  # ~0.2 MB of msgpack each
    await tq.put(samples)
    await tq.put_fields(samples[:1], ["reward"])  # a known uid: the reserve-then-write path
    batch = await tq.get("trainer", 4)
    # a column straight from the storage buffers (no Samples built), then the samples
    assert [c.tolist() for c in batch.column("response_ids")] == [s.response_ids for s in samples]
    assert {c.dtype for c in batch.column("rollout_logprobs")} == {np.dtype(np.float32)}
    assert batch.samples == samples
    await tq.ack(batch.batch_id)
    await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_array_samples_travel_as_bytes_and_come_back_as_read_only_arrays(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg())
    await check_array_samples_round_trip(tq)
    await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_put_returns_once_stored_and_a_refused_put_leaves_no_rows(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg(capacity=4, num_storage_units=1))
    (unit,) = tq._d.units
    await tq.put(make_samples(2, 2))
    assert await unit.num_rows.remote() == 4  # no flush needed: the unit stored them before the commit
    with pytest.raises(QueueFull):
        await tq.put(make_samples(1, prefix="x"), wait=False)
    with pytest.raises(ValueError, match="already in the queue"):
        await tq.put(make_samples(1))
    assert await unit.num_rows.remote() == 4  # the refused writes' rows were deleted
    batch = await tq.get("trainer", 4, timeout_s=0)
    await tq.ack(batch.batch_id)
    await asyncio.sleep(0.2)  # the controller's delete is fire and forget
    assert await unit.num_rows.remote() == 0
    assert_accounting(await tq.statistics_async())
    await tq.shutdown()


async def _until_gone(address: tuple[str, int]) -> None:
    """Wait until the actor serving ``address`` no longer accepts connections (``ray.kill``
    returns at once, and Ray may call an actor dead while its process still exits)."""
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection(*address)
        except OSError:
            return
        writer.close()
        await asyncio.sleep(0.05)
    raise AssertionError(f"the actor at {address} still accepts connections")


@pytest.mark.asyncio
async def test_ray_a_put_to_a_dead_storage_unit_registers_nothing_there_and_waits_for_its_replacement(
        ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg(num_storage_units=1))
    dead = tq._d.units[0]
    ray.kill(dead)  # the unit dies: the put cannot store its rows there
    await _until_gone(tq._d._addresses[1])
    await tq.put(make_samples(2, 2))  # no unit left: it waits for the replacement
    assert tq._d.units[0] != dead and await tq._d.units[0].num_rows.remote() == 4
    stats = await tq.statistics_async()
    assert stats.put == 4 and stats.pending == 4 and stats.dropped == 0  # registered once, on the replacement
    assert_accounting(stats)
    await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_reads_of_some_fields_and_later_fields_split_whole_rows(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg(num_storage_units=2))
    samples = make_samples(2, 2)
    await tq.put(samples)
    batch = await tq.get("trainer", 4, fields=["response_ids"], timeout_s=0)  # rows kept whole: split for this read
    assert [s.response_ids for s in batch.samples] == [s.response_ids for s in samples]
    assert all(s.prompt_ids == [] and s.reward is None for s in batch.samples)
    await tq.nack(batch.batch_id)
    for s in samples:
        s.reward = 0.5
    await tq.put_fields(samples, ["reward"])  # fields added to whole rows
    batch = await tq.get("trainer", 4, timeout_s=0)
    assert batch.samples == samples
    await tq.ack(batch.batch_id)
    await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_a_dead_storage_unit_loses_only_its_samples_counted_and_puts_go_on(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg(num_storage_units=2))
    await tq.put(make_samples(1, 4, prefix="a"))  # a put's samples go to one unit, round robin: unit 0
    await tq.put(make_samples(1, 4, prefix="b"))  # unit 1
    ray.kill(tq._d.units[0])
    await _until_gone(tq._d._addresses[1])
    with pytest.raises(StorageUnitLost) as lost:  # the read of unit 0's rows finds it gone
        await tq.get("trainer", 8, timeout_s=0)
    assert lost.value.unit == 0 and isinstance(lost.value, ConnectionError)
    stats = await tq.statistics_async()
    assert stats.dropped_by_reason == {"storage_lost": 4} and stats.pending == 4
    assert_accounting(stats)
    batch = await tq.get("trainer", 4, timeout_s=0)  # what unit 1 holds is intact
    assert batch.uids == [f"b{i}" for i in range(4)]
    await tq.ack(batch.batch_id)
    for prefix in ("c", "d"):  # later puts skip the dead unit
        await tq.put(make_samples(1, 4, prefix=prefix))
    batch = await tq.get("trainer", 8, timeout_s=0)
    assert sorted(batch.uids) == sorted(f"{p}{i}" for p in "cd" for i in range(4))
    await tq.ack(batch.batch_id)
    assert_accounting(await tq.statistics_async())
    await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_a_dead_storage_unit_is_replaced_and_takes_new_samples_for_every_client(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg(num_storage_units=2))
    await tq.put(make_samples(1, 4, prefix="a"))  # unit 0
    stale = pickle.loads(pickle.dumps(tq))  # a client that will never see the loss itself
    ray.kill(tq._d.units[0])
    await _until_gone(tq._d._addresses[1])
    for prefix in "bc":  # b on unit 1; c finds unit 0 dead (reported, a replacement starts), goes to unit 1
        await tq.put(make_samples(1, 4, prefix=prefix))
    stats = await tq.statistics_async()
    assert stats.dropped_by_reason == {"storage_lost": 4} and stats.pending == 8
    states = await tq._d._controller.unit_states.remote(True)  # once the replacement serves
    assert [(s.generation, s.live, s.gone) for s in states] == [(1, True, None), (0, True, None)]
    assert states[0].first_slot > 0 and await states[0].actor.num_rows.remote() == 0
    await asyncio.sleep(ray_deploy._RECHECK_S)  # this client's puts ask again about the unit it found down
    for prefix in "de":
        await tq.put(make_samples(1, 4, prefix=prefix))
    assert await states[0].actor.num_rows.remote() == 4  # new samples reach the replacement
    batch = await stale.get("trainer", 16, timeout_s=0)  # the stale client reads them there too
    assert sorted(batch.uids) == sorted(f"{p}{i}" for p in "bcde" for i in range(4))
    await stale.ack(batch.batch_id)
    assert_accounting(await tq.statistics_async())
    await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_with_no_room_for_replacements_puts_go_on_then_stop_with_one_line(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg(num_storage_units=2), ray_options={"replace_timeout_s": 0.5})
    nowhere = {"num_cpus": 0, "resources": {"no_such_node": 1}}  # as if no node left could hold one
    await tq._d._controller.__ray_call__.remote(lambda self: setattr(self, "_unit_options", [nowhere] * 2))
    for unit in (0, 1):
        ray.kill(tq._d.units[unit])
        await _until_gone(tq._d._addresses[unit + 1])
        if unit == 0:
            for prefix in "ab":  # a finds unit 0 dead and goes to unit 1, b goes there too
                await tq.put(make_samples(1, 2, prefix=prefix))
            await tq._d._controller.unit_states.remote(True)  # its replacement was given up
    with pytest.raises(StorageUnitLost) as gone:  # unit 1 found dead; no unit left, none coming
        await tq.put(make_samples(1, 2, prefix="c"))
    assert gone.value.unit == -1 and "\n" not in str(gone.value)
    assert str(gone.value) == ("every storage unit of this TransferQueue is gone: storage unit 0 was lost and not "
                               "replaced (no node could hold it within 0.5 s); storage unit 1 was lost and not "
                               "replaced (no node could hold it within 0.5 s)")
    stats = await tq.statistics_async()
    assert stats.dropped_by_reason == {"storage_lost": 4} and stats.pending == 0
    assert_accounting(stats)
    await tq.shutdown()


@pytest.mark.asyncio
async def test_ray_a_broken_connection_to_a_live_unit_loses_nothing(ray_cluster) -> None:
    tq = await TransferQueue.create(_cfg(num_storage_units=1))
    await tq.put(make_samples(1, 4))
    tq._d._unit_rpc[0]._conn.writer.transport.abort()  # the socket breaks under a call; the actor lives
    with pytest.raises(ConnectionError) as broken:
        await tq._d._unit_call(0, "num_rows")
    assert not isinstance(broken.value, StorageUnitLost)
    stats = await tq.statistics_async()
    assert stats.dropped == 0 and stats.pending == 4
    batch = await tq.get("trainer", 4, timeout_s=0)  # a new connection
    assert batch.samples == make_samples(1, 4)
    await tq.ack(batch.batch_id)
    await tq.shutdown()
