"""The socket transport of the Ray deployment (``transfer_queue/rpc.py``), without Ray."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from transfer_queue.errors import QueueFull
from transfer_queue.rpc import AuthenticationFailed, PeerLost, RpcClient, RpcServer, oob

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 32


class Target:
    def __init__(self) -> None:
        self.seen: list[object] = []
        self.release = asyncio.Event()

    def echo(self, *args: object) -> tuple:
        return args

    async def wait(self) -> str:
        await self.release.wait()
        return "released"

    def full(self) -> None:
        raise QueueFull("no room")

    def peer_lost(self) -> None:
        raise PeerLost("lost the connection to the controller")

    def note(self, value: object) -> None:
        self.seen.append(value)

    def hidden(self) -> None:  # not served
        raise AssertionError("must not run")


async def serve(target: Target) -> RpcServer:
    server = RpcServer(target, ("echo", "wait", "full", "note", "peer_lost"), SECRET)
    server.address = await server.start("127.0.0.1")
    return server


@pytest.mark.asyncio
async def test_calls_carry_buffers_out_of_band_and_run_concurrently() -> None:
    target = Target()
    server = await serve(target)
    client = RpcClient(server.address, SECRET, "the target")
    waiting = asyncio.create_task(client.call("wait"))  # holds its call open on the actor
    array = np.arange(300_000, dtype=np.int32)
    data = bytearray(b"x" * 1_000_000)
    got = await client.call("echo", 1, "two", array, oob(data))
    assert got[:2] == (1, "two")
    assert np.array_equal(got[2], array) and got[3] == bytes(data)
    assert not waiting.done()  # the echo was answered while the wait still runs
    target.release.set()
    assert await waiting == "released"
    await client.send("note", 7)  # fire and forget
    await client.call("echo")  # calls on one connection run in order of arrival
    assert target.seen == [7]
    client.close()


@pytest.mark.asyncio
async def test_errors_raise_as_themselves_and_unserved_methods_are_refused() -> None:
    server = await serve(Target())
    client = RpcClient(server.address, SECRET, "the target")
    with pytest.raises(QueueFull, match="no room"):
        await client.call("full")
    with pytest.raises(AttributeError, match="serves no method 'hidden'"):
        await client.call("hidden")
    with pytest.raises(ConnectionError, match="to the controller") as err:  # the actor's own peer, not ours
        await client.call("peer_lost")
    assert not isinstance(err.value, PeerLost)
    assert await client.call("echo", 1) == (1,)  # the connection is still good
    client.close()


@pytest.mark.asyncio
async def test_a_client_without_the_secret_is_dropped_before_anything_runs() -> None:
    target = Target()
    server = await serve(target)
    intruder = RpcClient(server.address, b"x" * 32, "the target")
    # the server proves itself first: the client finds it holds another secret and hangs up
    with pytest.raises(AuthenticationFailed, match="the target at 127.0.0.1:.* failed to prove it knows the secret"):
        await intruder.call("note", "intruder")
    assert target.seen == []
    intruder.close()
    await server.close()
    assert server.refused == {"hung_up": 1}


@pytest.mark.asyncio
async def test_a_lost_connection_fails_calls_in_flight_and_later_calls_name_the_actor() -> None:
    server = await serve(Target())
    client = RpcClient(server.address, SECRET, "storage unit 3")
    waiting = asyncio.create_task(client.call("wait"))
    await client.call("echo")
    server._server.close()  # the actor dies: its sockets close
    for task in list(server._tasks):
        task.cancel()
    client._conn.writer.transport.abort()
    with pytest.raises(PeerLost, match="storage unit 3"):
        await waiting
    with pytest.raises(PeerLost, match="storage unit 3"):
        await client.call("echo")
    client.close()


@pytest.mark.asyncio
async def test_one_connection_serves_10000_calls_and_open_fds_stay_flat() -> None:
    server = await serve(Target())
    client = RpcClient(server.address, SECRET, "the target")
    await client.call("echo")  # the one connection (two fds: its two ends in this process)
    before = len(os.listdir(f"/proc/{os.getpid()}/fd"))
    for i in range(10_000):
        assert await client.call("echo", i) == (i,)
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) - before <= 2  # a leak of one per call would be thousands
    await asyncio.sleep(0)  # the last call's task finishes after its answer is sent
    assert not server._tasks  # every call's task ended
    client.close()


@pytest.mark.asyncio
async def test_servers_take_the_first_free_ports_of_a_range_and_a_full_range_says_so() -> None:
    import socket

    with socket.socket() as probe:  # three ports that were free a moment ago, one of them then taken
        probe.bind(("127.0.0.1", 0))
        first = probe.getsockname()[1]
    if first + 2 > 65535:
        pytest.skip("ephemeral port at the top of the range")
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", first + 1))
        taken.listen()
    except OSError:
        taken.close()
        pytest.skip("the port next to a free one is in use")
    servers = [RpcServer(Target(), ("echo",), SECRET) for _ in range(3)]
    try:
        assert (await servers[0].start("127.0.0.1", (first, first + 2)))[1] == first
        assert (await servers[1].start("127.0.0.1", (first, first + 2)))[1] == first + 2  # first + 1 is taken
        with pytest.raises(OSError, match=f"no free port in {first}-{first + 2} on 127.0.0.1"):
            await servers[2].start("127.0.0.1", (first, first + 2))
        client = RpcClient(("127.0.0.1", first + 2), SECRET, "the ranged server")
        assert await client.call("echo", 7) == (7,)
        client.close()
    finally:
        taken.close()
        for server in servers[:2]:
            server._server.close()
