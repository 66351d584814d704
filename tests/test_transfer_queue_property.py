"""Property: over any interleaving of put / get / ack / nack / expire / drop,
``put == delivered + dropped + pending + in_flight`` holds after every step,
and in the end every sample put is delivered exactly once or dropped with a reason."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loop
from tests.helpers import assert_accounting, make_samples
from transfer_queue import QueueEmpty, QueueFull, TransferQueue, TransferQueueConfig

pytestmark = pytest.mark.timeout(60)

GROUP_SIZE = 2
LEASE_S = 10.0

op = st.one_of(
    st.tuples(st.just("put"), st.integers(1, 4), st.integers(0, 3)),  # groups, weight version
    st.tuples(st.just("put_partial"), st.integers(1, 3), st.integers(0, 3)),
    st.tuples(st.just("get"), st.sampled_from([2, 4]), st.sampled_from(["sequential", "grpo_group"]), st.booleans()),
    st.tuples(st.just("ack"), st.integers(0, 7)),
    st.tuples(st.just("nack"), st.integers(0, 7)),
    st.tuples(st.just("expire"), st.booleans()),
    st.tuples(st.just("drop"), st.integers(0, 7)),
    st.tuples(st.just("version"), st.integers(0, 4)),
)


async def _complete(tq: TransferQueue, samples: list) -> None:
    """Write the rest of partially written samples (a dropped one refuses: ValueError)."""
    for s in samples:
        try:
            await tq.put_fields([s], [f for f in s.__struct_fields__ if f not in ("uid", "group_id")])
        except ValueError as e:
            assert "already dropped" in str(e)


async def _drive(ops: list[tuple], deployment: str = "local") -> None:
    now = [0.0]
    if deployment == "local":
        tq = await TransferQueue.create(
            TransferQueueConfig(capacity=24, num_storage_units=2, lease_s=LEASE_S), clock=lambda: now[0]
        )
    else:  # real time: leases never run out by themselves here, "expire" forces them
        tq = await TransferQueue.create(TransferQueueConfig(capacity=24, num_storage_units=2, deployment="ray"))
    leases: list[str] = []
    delivered: list[str] = []
    held: dict[str, list[str]] = {}  # batch id -> uids
    put_uids: list[str] = []
    partial: list = []
    version = 0
    for step, o in enumerate(ops):
        kind = o[0]
        if kind in ("put", "put_partial"):
            samples = make_samples(o[1], GROUP_SIZE, version=o[2], prefix=f"{step}-")
            try:
                if kind == "put":
                    await tq.put(samples, wait=False)
                else:  # prompt now, the rest at the next put_partial (or never)
                    await tq.put_fields(samples, ["prompt_ids"], wait=False)
                    await _complete(tq, partial)
                    partial = samples
                put_uids.extend(s.uid for s in samples)
            except QueueFull:
                pass
            except RuntimeError:  # the partial sample was leased by a prompt-only get: fine
                pass
        elif kind == "get":
            _, size, sampler, staleness = o
            kwargs = {"current_version": version, "max_staleness": 1} if staleness else {}
            try:
                batch = await tq.get("c", size, sampler=sampler, group_size=GROUP_SIZE, timeout_s=0, **kwargs)
            except QueueEmpty:
                continue
            leases.append(batch.batch_id)
            held[batch.batch_id] = batch.uids
        elif kind in ("ack", "nack") and leases:
            batch_id = leases.pop(o[1] % len(leases))
            if kind == "ack":
                await tq.ack(batch_id)
                delivered.extend(held.pop(batch_id))
            else:
                await tq.nack(batch_id)
        elif kind == "expire" and deployment != "local":
            if o[1]:  # as if every consumer died
                await tq.expire_leases(force=True)
                leases = []
        elif kind == "expire":
            now[0] += LEASE_S if o[1] else LEASE_S / 2
            await tq.expire_leases()
            leases = [b for b in leases if b in {lease for lease in tq._d.controller._leases}]
        elif kind == "drop" and put_uids:
            uid = put_uids[o[1] % len(put_uids)]
            try:
                await tq.drop([uid], "policy")
            except (LookupError, RuntimeError):  # settled already, or leased
                pass
        elif kind == "version":
            version = o[1]
        assert_accounting(tq.statistics())

    # Consumers die, everything left is drained and acked.
    await tq.expire_leases(force=True)
    await _complete(tq, partial)
    while True:
        try:
            batch = await tq.get("drain", 1, timeout_s=0)
        except QueueEmpty:
            break
        await tq.ack(batch.batch_id)
        delivered.extend(batch.uids)
    stats = tq.statistics()
    assert_accounting(stats)
    assert stats.pending == stats.in_flight == 0
    assert len(delivered) == len(set(delivered)), "a sample was delivered twice"
    assert stats.put == len(put_uids) == len(delivered) + stats.dropped
    await tq.shutdown()


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=40))
def test_accounting_identity_holds_over_any_interleaving(ops: list[tuple]) -> None:
    loop.run(_drive(ops))


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_accounting_identity_holds_over_any_interleaving_on_ray() -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(ops=st.lists(op, min_size=10, max_size=40))
        def drive(ops: list[tuple]) -> None:
            loop.run(_drive(ops, "ray"))

        drive()
    finally:
        ray.shutdown()
