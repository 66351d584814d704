"""The queue's socket transport (``transfer_queue/rpc.py``) against peers that
misbehave: stalled or garbage hellos, the wrong secret on either side, frames over
the bound. Loopback only. Nothing a peer sends before the handshake succeeds may
be unpickled: every test here spies on ``pickle.loads`` and sends payloads whose
unpickling would set a flag."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import pickle
import struct

import pytest

from transfer_queue import rpc
from transfer_queue.rpc import AuthenticationFailed, FrameTooLarge, PeerLost, RpcClient, RpcServer

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 32
WRONG = b"w" * 32
UNPICKLED: list[str] = []


def _mark(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Trap:
    """Unpickling it calls ``_mark``: a flag that says a peer's bytes were decoded."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __reduce__(self) -> tuple:
        return (_mark, (self.tag,))


def trap_frame(message: object) -> bytes:
    """A well-formed frame (rpc's layout) carrying ``message``."""
    body = pickle.dumps(message, protocol=5)
    return rpc._HEAD.pack(len(body), 0) + body


class Target:
    def __init__(self) -> None:
        self.seen: list[object] = []

    def echo(self, *args: object) -> tuple:
        return args

    def note(self, value: object) -> None:
        self.seen.append(value)

    def big(self, n: int) -> bytes:
        return b"x" * n


@pytest.fixture
def loads_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ``pickle.loads`` call (rpc decodes frames with it), recorded; the trap's flag cleared."""
    calls: list[int] = []
    real = pickle.loads

    def spy(data, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        calls.append(len(data))
        return real(data, *args, **kwargs)

    UNPICKLED.clear()
    assert pickle.loads(trap_frame(Trap("sanity"))[rpc._HEAD.size:]) == "sanity" and UNPICKLED == ["sanity"]
    UNPICKLED.clear()  # the trap springs when unpickled: its absence below means nothing was
    monkeypatch.setattr(rpc.pickle, "loads", spy)
    return calls


async def serve(target: Target, **limits: float) -> RpcServer:
    server = RpcServer(target, ("echo", "note", "big"), SECRET, **limits)
    server.address = await server.start("127.0.0.1")
    return server


async def read_to_eof(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout_s)


@pytest.mark.asyncio
async def test_a_peer_that_connects_and_says_nothing_is_dropped_after_the_hello_timeout(loads_calls) -> None:
    server = await serve(Target(), hello_timeout_s=0.2)
    reader, writer = await asyncio.open_connection(*server.address)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await read_to_eof(reader, 5.0) == b""  # the server closed it, having sent nothing
    assert 0.15 <= loop.time() - t0 < 3.0
    assert server.refused == {"hello_timeout": 1}
    assert not server._connections  # its handler ended
    writer.close()
    await server.close()
    assert loads_calls == []


@pytest.mark.asyncio
async def test_garbage_bytes_are_refused_and_never_unpickled(loads_calls) -> None:
    server = await serve(Target())
    garbage = [
        os.urandom(200),  # noise
        trap_frame((1, "note", (Trap("server"),))),  # a well-formed call frame, without a handshake
        rpc._MAGIC + os.urandom(32),  # the right magic, then a proof that is noise (below)
    ]
    for i, data in enumerate(garbage):
        reader, writer = await asyncio.open_connection(*server.address)
        writer.write(data)
        if i == 2:
            assert len(await reader.readexactly(64)) == 64  # the server's nonce and proof
            writer.write(os.urandom(32) + trap_frame((1, "note", (Trap("after"),))))
        assert (await read_to_eof(reader, 5.0)) == b""  # dropped with no accept byte
        writer.close()
    await server.close()
    assert server.refused == {"bad_hello": 2, "bad_proof": 1}
    assert loads_calls == [] and UNPICKLED == []


@pytest.mark.asyncio
async def test_a_client_with_the_wrong_secret_that_ignores_the_servers_proof_is_refused(loads_calls) -> None:
    target = Target()
    server = await serve(target)
    reader, writer = await asyncio.open_connection(*server.address)
    nonce = os.urandom(32)
    writer.write(rpc._MAGIC + nonce)
    reply = await reader.readexactly(64)
    forged = rpc._proof(WRONG, b"client", nonce, reply[:32])
    writer.write(forged + trap_frame((1, "note", (Trap("intruder"),))))
    assert await read_to_eof(reader, 5.0) == b""
    writer.close()
    await server.close()
    assert server.refused == {"bad_proof": 1}
    assert target.seen == [] and loads_calls == [] and UNPICKLED == []


@pytest.mark.asyncio
async def test_a_server_without_the_secret_is_refused_before_the_client_unpickles_anything(loads_calls) -> None:
    """A fake server that answers the hello with a proof made with another secret,
    then sends a reply frame at once: the client refuses it, sends no call, reads no frame."""
    received: list[bytes] = []

    async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await reader.readexactly(len(rpc._MAGIC) + 32)
        nonce = os.urandom(32)
        writer.write(nonce + rpc._proof(WRONG, b"server", hello[len(rpc._MAGIC):], nonce))
        writer.write(trap_frame((1, True, Trap("fake server"))))
        await writer.drain()
        received.append(await reader.read())  # whatever the client still sends, until it hangs up
        writer.close()

    fake_server = await asyncio.start_server(fake, "127.0.0.1", 0)
    address = fake_server.sockets[0].getsockname()[:2]
    client = RpcClient(address, SECRET, "the controller")
    with pytest.raises(AuthenticationFailed, match="the controller at 127.0.0.1:.* failed to prove it knows the secret"):
        await client.call("note", Trap("call"))
    for _ in range(100):
        if received:
            break
        await asyncio.sleep(0.01)
    assert received == [b""]  # no proof of ours, no call
    assert loads_calls == [] and UNPICKLED == []
    client.close()
    fake_server.close()
    await fake_server.wait_closed()


@pytest.mark.asyncio
async def test_a_server_that_never_answers_the_hello_times_out_the_client() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    fake_server = await asyncio.start_server(silent, "127.0.0.1", 0)
    client = RpcClient(fake_server.sockets[0].getsockname()[:2], SECRET, "storage unit 1", hello_timeout_s=0.2)
    with pytest.raises(AuthenticationFailed, match="storage unit 1 at .* did not answer the handshake within 0.2 s"):
        await client.call("echo")
    client.close()
    fake_server.close()
    await fake_server.wait_closed()


@pytest.mark.asyncio
async def test_the_secret_never_crosses_the_wire_and_each_side_proves_it() -> None:
    """A relay between client and server records both directions: a call succeeds,
    and neither stream holds the secret."""
    server = await serve(Target())
    to_server, to_client = bytearray(), bytearray()

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, log: bytearray) -> None:
        while data := await src.read(65536):
            log += data
            dst.write(data)
        dst.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*server.address)
        await asyncio.gather(pipe(reader, up_writer, to_server), pipe(up_reader, writer, to_client))

    relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
    client = RpcClient(relay_server.sockets[0].getsockname()[:2], SECRET, "the target")
    assert await client.call("echo", "hi") == ("hi",)
    client.close()
    await server.close()
    relay_server.close()
    assert SECRET not in bytes(to_server) and SECRET not in bytes(to_client)
    nonce_c = bytes(to_server[len(rpc._MAGIC):len(rpc._MAGIC) + 32])
    nonce_s, proof_s = bytes(to_client[:32]), bytes(to_client[32:64])
    assert hmac.compare_digest(proof_s, rpc._proof(SECRET, b"server", nonce_c, nonce_s))
    assert proof_s == hmac.new(SECRET, b"server|" + nonce_c + nonce_s, hashlib.sha256).digest()
    assert to_server[len(rpc._MAGIC) + 32:][:32] == rpc._proof(SECRET, b"client", nonce_c, nonce_s)


@pytest.mark.asyncio
async def test_frames_over_the_bound_are_refused_with_a_clear_error_on_either_side(loads_calls) -> None:
    server = await serve(Target(), max_frame_bytes=4096)
    # the sender's own bound: nothing is written, the connection stays good
    small = RpcClient(server.address, SECRET, "the target", max_frame_bytes=4096)
    with pytest.raises(FrameTooLarge, match="a message of .* bytes is over max_frame_bytes=4096"):
        await small.call("echo", b"x" * 10_000)
    assert await small.call("echo", 1) == (1,)
    # the server's answer would be over its bound: the caller gets why, as itself
    with pytest.raises(FrameTooLarge, match="over max_frame_bytes=4096"):
        await small.call("big", 10_000)
    assert await small.call("echo", 2) == (2,)
    small.close()
    # a client with a larger bound: the server refuses the frame from its header, says why, and closes
    large = RpcClient(server.address, SECRET, "the target")
    calls_before = len(loads_calls)
    with pytest.raises(FrameTooLarge, match="the target: a message of more than 4096 bytes arrived"):
        await large.call("echo", b"x" * 1_000_000)
    assert server.refused == {"frame_too_large": 1}
    assert len(loads_calls) == calls_before + 1  # only the server's notice, on the client; the body was never read
    assert await large.call("echo", 3) == (3,)  # a new connection
    large.close()
    await server.close()


@pytest.mark.asyncio
async def test_a_reply_over_the_clients_bound_fails_the_call_and_the_next_call_reconnects(loads_calls) -> None:
    server = await serve(Target())
    client = RpcClient(server.address, SECRET, "the target", max_frame_bytes=4096)
    with pytest.raises(FrameTooLarge, match="the target: a message of more than 4096 bytes arrived"):
        await client.call("big", 100_000)
    assert await client.call("echo", 1) == (1,)
    client.close()
    await server.close()


def test_a_header_claiming_a_huge_frame_is_refused_before_reading_its_body() -> None:
    """The bound is checked from the header alone: a peer cannot make us wait for
    (or allocate) 2**63 bytes."""

    async def go() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(rpc._HEAD.pack(2**63, 0))
        with pytest.raises(FrameTooLarge, match="more than 1024 bytes"):
            await rpc._read_frame(reader, 1024)
        reader = asyncio.StreamReader()
        reader.feed_data(rpc._HEAD.pack(10, 2) + struct.pack("<2Q", 2**40, 1))
        with pytest.raises(FrameTooLarge, match="a message of .* bytes arrived; max_frame_bytes=1024"):
            await rpc._read_frame(reader, 1024)

    asyncio.run(go())


def test_limits_and_secrets_are_checked() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RpcClient(("127.0.0.1", 1), b"short", "x")
    with pytest.raises(ValueError, match="hello_timeout_s must be > 0"):
        RpcServer(Target(), (), SECRET, hello_timeout_s=0)
    with pytest.raises(ValueError, match="max_frame_bytes must be >= 1"):
        RpcServer(Target(), (), SECRET, max_frame_bytes=0)
    client = RpcClient(("127.0.0.1", 1), SECRET, "x", hello_timeout_s=3.0, max_frame_bytes=123)
    copy = pickle.loads(pickle.dumps(client))  # to another process: the limits travel with it
    assert (copy._hello_timeout_s, copy._max_frame_bytes, copy._secret) == (3.0, 123, SECRET)


@pytest.mark.asyncio
async def test_an_unreachable_server_is_peer_lost_not_an_authentication_failure() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = RpcClient(("127.0.0.1", port), SECRET, "the controller")
    with pytest.raises(PeerLost, match="cannot reach the controller") as err:
        await client.call("echo")
    assert not isinstance(err.value, AuthenticationFailed)
    client.close()
