"""The ``local`` deployment served from a queue-host actor (``transfer_queue/served.py``),
as the ``process`` runtime uses it: the host and its client in this process, over a
loopback socket. New samples travel as one msgpack body in one call (``put_new``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import pytest_asyncio

from contracts.sample import pack_tokens
from tests.helpers import assert_accounting, check_array_samples_round_trip, make_samples
from transfer_queue import QueueClosed, QueueFull, TransferQueue, TransferQueueConfig
from transfer_queue.served import QueueHost, ServedDeployment, new_secret

pytestmark = pytest.mark.timeout(30)


@pytest_asyncio.fixture
async def served():
    """(client, host) of a served queue of capacity 8, one storage unit."""
    cfg = TransferQueueConfig(capacity=8, num_storage_units=1, lease_s=math.inf)
    secret = new_secret()
    host = QueueHost(cfg, secret, host="127.0.0.1")
    await host.setup()
    client = TransferQueue(cfg, ServedDeployment(await host.address(), secret))
    yield client, host
    await client.shutdown()
    await host.close()


@pytest.mark.asyncio
async def test_a_put_is_one_call_and_samples_come_back_as_they_went(served, monkeypatch) -> None:
    client, host = served
    calls: list[str] = []
    rpc_call = client._d._rpc.call

    async def counted(method: str, *args):
        calls.append(method)
        return await rpc_call(method, *args)

    monkeypatch.setattr(client._d._rpc, "call", counted)
    packed = [pack_tokens(s) for s in make_samples(2, 2, version=1, prefix="p", num_tokens=300)]
    await client.put(packed)
    assert calls == ["put_new"]  # reserve, rows and commit: one round trip
    rows = host._d.units[0].get_rows(list(range(4)), None)
    assert [r["uid"] for r in rows] == [s.uid for s in packed]
    assert all(r["response_ids"].dtype == np.int32 and not r["response_ids"].flags.writeable for r in rows)
    batch = await client.get("trainer", 4, sampler="grpo_group", group_size=2)
    for got, want in zip(batch.samples, packed):
        assert got.response_ids.tolist() == want.response_ids.tolist() and got.meta == want.meta
        assert got.rollout_logprobs.tolist() == want.rollout_logprobs.tolist() and got.reward == want.reward
    await client.ack(batch.batch_id)
    await check_array_samples_round_trip(client)  # lists and unpacked arrays of other dtypes too
    assert_accounting(await client.statistics_async())


@pytest.mark.asyncio
async def test_a_refused_put_raises_what_the_controller_raised_and_registers_nothing(served) -> None:
    client, _ = served
    await client.put(make_samples(8, prefix="a"))
    with pytest.raises(QueueFull):
        await client.put(make_samples(1, prefix="b"), wait=False)
    batch = await client.get("trainer", 2)
    await client.ack(batch.batch_id)
    with pytest.raises(ValueError, match="a2"):  # a uid already in the queue
        await client.put(make_samples(3, prefix="a")[2:])
    stats = await client.statistics_async()
    assert stats.pending == 6 and stats.put == 8  # the refused puts registered nothing
    await client.close()
    with pytest.raises(QueueClosed):
        await client.put(make_samples(1, prefix="c"))
