"""Messages between TransferQueue clients and its Ray actors, over a direct socket.

Ray places, starts, supervises and kills the controller and storage actors; the
calls of the data path (put, get, ack, ...) do not go through Ray's actor calls.
Each actor serves a TCP socket on its node's address, and every client process
keeps one connection per actor, on its loop. Why: on a small host a Ray actor
call costs about a millisecond of CPU at each end, whatever it carries, and a
put or a get of a batch takes several; a message over a socket costs tens of
microseconds, plus the copy of its bytes.

A message is one frame: a header (sizes), a pickle (protocol 5) of the call or
its answer, and the pickle's out-of-band buffers (numpy arrays, and the bytes a
caller wraps in ``pickle.PickleBuffer``) as they are, so sample data is never
copied into the pickle. Calls on one connection run concurrently on the actor
(a get waiting for a batch does not hold up a put); answers carry the call's
id. An exception raised by the actor's method is raised by the caller's ``call``,
as itself.

Security: the deployment's secret (32 random bytes that the creating client made
and handed to the actors and to other clients through Ray, which authenticates
its peers) never crosses the wire. A connection opens with a challenge-response
handshake, each side proving it knows the secret:

    client -> server   magic, client nonce Nc (32 random bytes)
    server -> client   server nonce Ns, HMAC-SHA256(secret, "server" | Nc | Ns)
    client -> server   HMAC-SHA256(secret, "client" | Nc | Ns)      (only if the server's proof holds)
    server -> client   one accept byte                               (only if the client's proof holds)

Proofs are compared with ``hmac.compare_digest``; the role labels keep either
side's proof from being replayed as the other's. The whole handshake must end
within ``hello_timeout_s`` (a peer that connects and says nothing is dropped).
Nothing is unpickled before it succeeds, on either side: a peer that fails is
dropped (the server counts it in ``refused``; the client raises
``AuthenticationFailed``) having sent only bytes that were compared, never
decoded. This authenticates peers; it does not encrypt: anyone who can read the
network between nodes can read the frames.

Frames are bounded: a message (its pickle and out-of-band buffers) over
``max_frame_bytes`` is refused by its sender with ``FrameTooLarge`` before
anything is written, and by its receiver from the header alone, before the body
is read (the server then tells the client why and closes the connection).

Failure: when an actor dies its connections close, and every call in flight on
them (and every later one) raises ``PeerLost`` (a ``ConnectionError``) naming
the actor; a ``ConnectionError`` the actor's method raised stays what it was.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import itertools
import pickle
import secrets
import struct
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, cast

__all__ = [
    "DEFAULT_HELLO_TIMEOUT_S",
    "DEFAULT_MAX_FRAME_BYTES",
    "AuthenticationFailed",
    "FrameTooLarge",
    "PeerLost",
    "PendingReplies",
    "RpcClient",
    "RpcServer",
    "oob",
]

_HEAD = struct.Struct("<QI")  # pickle length, number of out-of-band buffers (each: its u64 length follows)
_NO_REPLY = 0  # request id of a call whose caller wants no answer
# A stream reader stops reading the socket while it buffers twice this much: above the
# largest frame (a batch's rows), so a big frame is read in one go, not in 64 KiB turns.
_READ_LIMIT = 32 << 20


DEFAULT_HELLO_TIMEOUT_S = 10.0
"""Seconds a peer has to complete the handshake (``TransferQueueConfig.hello_timeout_s``)."""
DEFAULT_MAX_FRAME_BYTES = 1 << 30
"""The largest message, pickle and buffers (``TransferQueueConfig.max_frame_bytes``)."""

_MAGIC = b"asyncrl-tq-rpc/2"  # names the protocol: an old or foreign peer is refused at once
_NONCE_BYTES = 32
_MAC_BYTES = hashlib.sha256().digest_size
_ACCEPT = b"\x01"
_MIN_SECRET_BYTES = 16


class PeerLost(ConnectionError):
    """The connection to the actor is gone (it died, or cannot be reached)."""


class AuthenticationFailed(PeerLost):
    """The handshake failed: the peer does not know the secret, does not speak this
    protocol, or did not finish within the hello timeout. Nothing it sent was unpickled."""


class FrameTooLarge(ValueError):
    """A message is over ``max_frame_bytes`` (its sender's or its receiver's bound)."""

    def __reduce__(self) -> tuple:
        return (FrameTooLarge, self.args)


def _proof(secret: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, role + b"|" + client_nonce + server_nonce, hashlib.sha256).digest()


def _check_limits(secret: bytes, hello_timeout_s: float, max_frame_bytes: int) -> None:
    if not isinstance(secret, bytes) or len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"the secret must be at least {_MIN_SECRET_BYTES} bytes")
    if not hello_timeout_s > 0:
        raise ValueError(f"hello_timeout_s must be > 0, got {hello_timeout_s}")
    if max_frame_bytes < 1:
        raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")


def oob(buf: bytes | bytearray | memoryview) -> pickle.PickleBuffer:
    """Mark ``buf`` to travel out of band (as is, not copied into the pickle)."""
    return pickle.PickleBuffer(buf)


def _frame(obj: object, max_bytes: int) -> list[bytes | memoryview]:
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    total = len(body) + sum(r.nbytes for r in raws)
    if total > max_bytes:
        raise FrameTooLarge(f"a message of {total} bytes is over max_frame_bytes={max_bytes} "
                            "(transfer_queue.max_frame_bytes)")
    head = _HEAD.pack(len(body), len(raws)) + struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    return [head, body, *raws]


async def _read_frame(reader: asyncio.StreamReader, max_bytes: int) -> Any:
    """One message; ``FrameTooLarge`` from its header, before its body is read."""
    size, num = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    if size + 8 * num > max_bytes:
        raise FrameTooLarge(f"a message of more than {max_bytes} bytes arrived (header: {size}-byte pickle, "
                            f"{num} buffers); max_frame_bytes={max_bytes} (transfer_queue.max_frame_bytes)")
    sizes = struct.unpack(f"<{num}Q", await reader.readexactly(8 * num)) if num else ()
    if size + sum(sizes) > max_bytes:
        raise FrameTooLarge(f"a message of {size + sum(sizes)} bytes arrived; max_frame_bytes={max_bytes} "
                            "(transfer_queue.max_frame_bytes)")
    body = await reader.readexactly(size)
    buffers = [await reader.readexactly(n) for n in sizes]
    return pickle.loads(body, buffers=buffers)


class PendingReplies:
    """The futures of the calls in flight on one connection, by call id: a reply
    settles its own call's (one its caller stopped waiting for is left be); a lost
    connection fails them all. Calls are answered in any order. Used by this
    module's client and by ``actors/runtime/process.py``'s process handles."""

    def __init__(self) -> None:
        self._futures: dict[int, asyncio.Future] = {}

    def add(self, call_id: int, fut: asyncio.Future) -> None:
        self._futures[call_id] = fut

    def discard(self, call_id: int) -> None:
        """Forget ``call_id`` (its caller stopped waiting, or the call was never sent)."""
        self._futures.pop(call_id, None)

    def settle(self, call_id: int, ok: bool, value: object) -> None:
        """The reply to ``call_id``: its result when ``ok``, else the exception it raised."""
        fut = self._futures.pop(call_id, None)
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(cast(BaseException, value))  # what the peer's call raised

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """The connection is gone: every call still waiting raises ``error()``."""
        futures, self._futures = self._futures, {}
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(error())


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class RpcServer:
    """Serves ``methods`` of ``target`` to clients that prove they know ``secret``.

    ``refused`` counts the connections dropped, by reason: ``hello_timeout``,
    ``bad_hello`` (not this protocol), ``bad_proof`` (wrong secret), ``hung_up``
    (closed during the handshake: a client that refused our proof does this),
    ``frame_too_large`` (after the handshake)."""

    def __init__(self, target: object, methods: Iterable[str], secret: bytes, *,
                 hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        _check_limits(secret, hello_timeout_s, max_frame_bytes)
        self._target, self._methods, self._secret = target, frozenset(methods), secret
        self._hello_timeout_s, self._max_frame_bytes = hello_timeout_s, max_frame_bytes
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._connections: dict[asyncio.StreamWriter, asyncio.Future] = {}  # -> done when its handler ends
        self.refused: Counter[str] = Counter()

    async def start(self, host: str, ports: tuple[int, int] | None = None) -> tuple[str, int]:
        """Listen on ``host``: on any free port, or on the first free one in
        ``ports`` (first, last; for clusters that open only a range between nodes)."""
        for port in range(ports[0], ports[1] + 1) if ports else (0,):
            try:
                self._server = await asyncio.start_server(self._serve, host, port, limit=_READ_LIMIT)
                return host, self._server.sockets[0].getsockname()[1]
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or not ports:
                    raise
        assert ports is not None  # without a range, port 0 was taken or its error raised
        raise OSError(errno.EADDRINUSE, f"no free port in {ports[0]}-{ports[1]} on {host}")

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening, end the calls in flight and close every connection, so the
        handlers return (a handler cancelled at loop shutdown would be logged as an error)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in list(self._connections):
            writer.close()
        if self._connections:
            await asyncio.wait(list(self._connections.values()), timeout=timeout_s)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str | None:
        """The server's half of the handshake (module docstring); None when the client
        proved it knows the secret, else the reason it is refused. Only compares bytes."""
        hello = await reader.readexactly(len(_MAGIC) + _NONCE_BYTES)
        if not hmac.compare_digest(hello[: len(_MAGIC)], _MAGIC):
            return "bad_hello"
        client_nonce, server_nonce = hello[len(_MAGIC):], secrets.token_bytes(_NONCE_BYTES)
        writer.write(server_nonce + _proof(self._secret, b"server", client_nonce, server_nonce))
        await writer.drain()
        answer = await reader.readexactly(_MAC_BYTES)
        if not hmac.compare_digest(answer, _proof(self._secret, b"client", client_nonce, server_nonce)):
            return "bad_proof"
        writer.write(_ACCEPT)
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ended = self._connections[writer] = asyncio.get_running_loop().create_future()
        try:
            try:
                refused = await asyncio.wait_for(self._handshake(reader, writer), self._hello_timeout_s)
            except asyncio.TimeoutError:
                refused = "hello_timeout"
            except (asyncio.IncompleteReadError, ConnectionError):
                refused = "hung_up"  # during the handshake (a client refusing our proof does this)
            if refused is not None:
                self.refused[refused] += 1
                return
            while True:
                try:
                    rid, method, args = await _read_frame(reader, self._max_frame_bytes)
                except FrameTooLarge as e:
                    self.refused["frame_too_large"] += 1
                    # the rest of the stream cannot be framed: say why (rid 0: the connection), then close
                    writer.writelines(_frame((_NO_REPLY, False, e), self._max_frame_bytes))
                    await writer.drain()
                    return
                task = asyncio.get_running_loop().create_task(self._run(rid, method, args, writer))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            writer.close()
            del self._connections[writer]
            ended.set_result(None)

    async def _run(self, rid: int, method: str, args: tuple, writer: asyncio.StreamWriter) -> None:
        try:
            if method not in self._methods:
                raise AttributeError(f"{type(self._target).__name__} serves no method {method!r}")
            result = getattr(self._target, method)(*args)
            if asyncio.iscoroutine(result):
                result = await result
            reply = (rid, True, result)
        except PeerLost as e:  # the actor lost one of *its* peers: not the caller's connection
            reply = (rid, False, ConnectionError(str(e)))
        except Exception as e:
            reply = (rid, False, _picklable(e))
        if rid == _NO_REPLY or writer.is_closing():
            return
        try:
            frame = _frame(reply, self._max_frame_bytes)
        except FrameTooLarge as e:  # the answer is too big to send: the caller gets why
            frame = _frame((rid, False, e), self._max_frame_bytes)
        writer.writelines(frame)
        try:
            await writer.drain()
        except ConnectionError:
            pass


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str,
                 max_frame_bytes: int) -> None:
        self.writer, self.name, self.max_frame_bytes = writer, name, max_frame_bytes
        self.pending = PendingReplies()
        self.closed: BaseException | None = None
        self.reader_task = asyncio.get_running_loop().create_task(self._read_replies(reader))

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                rid, ok, value = await _read_frame(reader, self.max_frame_bytes)
                if rid == _NO_REPLY and not ok:  # the server refused this connection (e.g. a frame too large)
                    raise value
                self.pending.settle(rid, ok, value)
        except BaseException as e:  # EOF, a reset, or the loop going away: fail every call in flight
            self.closed = PeerLost(f"lost the connection to {self.name} ({type(e).__name__}: {e})")
            # a frame over a bound (ours, or the server's notice) fails the calls in flight as itself
            error = FrameTooLarge(f"{self.name}: {e}") if isinstance(e, FrameTooLarge) else self.closed
            self.pending.fail_all(lambda: error)  # one error, the same for every call
            self.writer.close()
            if isinstance(e, asyncio.CancelledError):
                raise


class RpcClient:
    """Calls an ``RpcServer`` at ``address``; connects on first use, once per loop, and
    reconnects after a lost connection (which fails if the actor is gone). Before the
    first call on a connection the server must prove it knows ``secret`` (module docstring)."""

    def __init__(self, address: tuple[str, int], secret: bytes, name: str, *,
                 hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        _check_limits(secret, hello_timeout_s, max_frame_bytes)
        self._address: tuple[str, int] = (address[0], address[1])  # a list when it came through msgpack
        self._secret, self._name = secret, name
        self._hello_timeout_s, self._max_frame_bytes = hello_timeout_s, max_frame_bytes
        self._conn: _Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future | None = None
        self._ids: Callable[[], int] = itertools.count(1).__next__

    def __reduce__(self) -> tuple:  # to another process: the address, not the connection
        return (_client, (self._address, self._secret, self._name, self._hello_timeout_s, self._max_frame_bytes))

    async def _connection(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = self._conn
        if conn is not None and self._loop is loop and conn.closed is None:
            return conn
        if self._connecting is not None and self._loop is loop:
            return await asyncio.shield(self._connecting)
        self._loop, self._connecting = loop, loop.create_future()
        try:
            try:
                reader, writer = await asyncio.open_connection(*self._address, limit=_READ_LIMIT)
            except OSError as e:
                raise PeerLost(f"cannot reach {self._name} at {self._where()}: {e}") from None
            try:
                await asyncio.wait_for(self._handshake(reader, writer), self._hello_timeout_s)
            except BaseException as e:
                writer.close()
                if isinstance(e, asyncio.TimeoutError):
                    raise AuthenticationFailed(f"{self._name} at {self._where()} did not answer the handshake "
                                               f"within {self._hello_timeout_s} s") from None
                if isinstance(e, (asyncio.IncompleteReadError, ConnectionError)) and not isinstance(e, PeerLost):
                    raise AuthenticationFailed(f"{self._name} at {self._where()} closed the connection during the "
                                               f"handshake ({type(e).__name__})") from None
                raise
            self._conn = _Connection(reader, writer, self._name, self._max_frame_bytes)
            self._connecting.set_result(self._conn)
            return self._conn
        except BaseException as e:
            self._connecting.set_exception(e)
            self._connecting.exception()  # retrieved: a later call retries
            raise
        finally:
            self._connecting = None

    def _where(self) -> str:
        return f"{self._address[0]}:{self._address[1]}"

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The client's half (module docstring): the server proves itself first, so a
        peer without the secret never gets a call, nor anything of ours unpickled."""
        client_nonce = secrets.token_bytes(_NONCE_BYTES)
        writer.write(_MAGIC + client_nonce)
        await writer.drain()
        reply = await reader.readexactly(_NONCE_BYTES + _MAC_BYTES)
        server_nonce, server_proof = reply[:_NONCE_BYTES], reply[_NONCE_BYTES:]
        if not hmac.compare_digest(server_proof, _proof(self._secret, b"server", client_nonce, server_nonce)):
            raise AuthenticationFailed(f"{self._name} at {self._where()} failed to prove it knows the secret "
                                       "(another deployment's server, or not ours): refused")
        writer.write(_proof(self._secret, b"client", client_nonce, server_nonce))
        await writer.drain()
        if await reader.read(1) != _ACCEPT:
            raise AuthenticationFailed(f"{self._name} at {self._where()} refused this client's proof "
                                       "(it holds another secret)")

    async def call(self, method: str, *args: object) -> Any:
        """``method(*args)`` on the actor; its result, or its exception raised here."""
        conn = await self._connection()
        rid = self._ids()
        fut = asyncio.get_running_loop().create_future()
        conn.pending.add(rid, fut)
        try:
            await self._write(conn, (rid, method, args))
            return await fut
        finally:
            conn.pending.discard(rid)

    async def send(self, method: str, *args: object) -> None:
        """``method(*args)`` on the actor without waiting for (or getting) its answer."""
        await self._write(await self._connection(), (_NO_REPLY, method, args))

    async def _write(self, conn: _Connection, message: tuple) -> None:
        conn.writer.writelines(_frame(message, self._max_frame_bytes))  # FrameTooLarge before a byte is written
        try:
            await conn.writer.drain()
        except ConnectionError as e:
            raise PeerLost(f"lost the connection to {self._name} ({type(e).__name__}: {e})") from None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.writer.close()
            self._conn.reader_task.cancel()
            self._conn = None


def _client(address: tuple[str, int], secret: bytes, name: str, hello_timeout_s: float,
            max_frame_bytes: int) -> RpcClient:
    return RpcClient(address, secret, name, hello_timeout_s=hello_timeout_s, max_frame_bytes=max_frame_bytes)
