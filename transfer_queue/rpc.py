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

Security: a connection must first send the deployment's secret (32 random bytes
that the creating client made and handed to the actors and to other clients
through Ray, which authenticates its peers); a peer without it is dropped
before anything it sent is unpickled.

Failure: when an actor dies its connections close, and every call in flight on
them (and every later one) raises ``PeerLost`` (a ``ConnectionError``) naming
the actor; a ``ConnectionError`` the actor's method raised stays what it was.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import itertools
import pickle
import struct
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["PeerLost", "RpcClient", "RpcServer", "oob"]

_HEAD = struct.Struct("<QI")  # pickle length, number of out-of-band buffers (each: its u64 length follows)
_NO_REPLY = 0  # request id of a call whose caller wants no answer
# A stream reader stops reading the socket while it buffers twice this much: above the
# largest frame (a batch's rows), so a big frame is read in one go, not in 64 KiB turns.
_READ_LIMIT = 32 << 20


class PeerLost(ConnectionError):
    """The connection to the actor is gone (it died, or cannot be reached)."""


def oob(buf: bytes | bytearray | memoryview) -> pickle.PickleBuffer:
    """Mark ``buf`` to travel out of band (as is, not copied into the pickle)."""
    return pickle.PickleBuffer(buf)


def _frame(obj: Any) -> list[Any]:
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    head = _HEAD.pack(len(body), len(raws)) + struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    return [head, body, *raws]


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    size, num = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    sizes = struct.unpack(f"<{num}Q", await reader.readexactly(8 * num)) if num else ()
    body = await reader.readexactly(size)
    buffers = [await reader.readexactly(n) for n in sizes]
    return pickle.loads(body, buffers=buffers)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class RpcServer:
    """Serves ``methods`` of ``target`` to clients that know ``secret``."""

    def __init__(self, target: Any, methods: Iterable[str], secret: bytes) -> None:
        self._target, self._methods, self._secret = target, frozenset(methods), secret
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._connections: dict[asyncio.StreamWriter, asyncio.Future] = {}  # -> done when its handler ends

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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ended = self._connections[writer] = asyncio.get_running_loop().create_future()
        try:
            hello = await reader.readexactly(len(self._secret))
            if not hmac.compare_digest(hello, self._secret):
                return
            while True:
                rid, method, args = await _read_frame(reader)
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
        writer.writelines(_frame(reply))
        try:
            await writer.drain()
        except ConnectionError:
            pass


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> None:
        self.writer, self.name = writer, name
        self.pending: dict[int, asyncio.Future] = {}
        self.closed: BaseException | None = None
        self.reader_task = asyncio.get_running_loop().create_task(self._read_replies(reader))

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                rid, ok, value = await _read_frame(reader)
                fut = self.pending.pop(rid, None)
                if fut is None or fut.done():
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        except BaseException as e:  # EOF, a reset, or the loop going away: fail every call in flight
            self.closed = PeerLost(f"lost the connection to {self.name} ({type(e).__name__}: {e})")
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(self.closed)
            self.pending.clear()
            self.writer.close()
            if isinstance(e, asyncio.CancelledError):
                raise


class RpcClient:
    """Calls an ``RpcServer`` at ``address``; connects on first use, once per loop, and
    reconnects after a lost connection (which fails if the actor is gone)."""

    def __init__(self, address: tuple[str, int], secret: bytes, name: str) -> None:
        self._address, self._secret, self._name = tuple(address), secret, name
        self._conn: _Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future | None = None
        self._ids: Callable[[], int] = itertools.count(1).__next__

    def __reduce__(self) -> tuple:  # to another process: the address, not the connection
        return (RpcClient, (self._address, self._secret, self._name))

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
                raise PeerLost(f"cannot reach {self._name} at {self._address[0]}:{self._address[1]}: {e}") from None
            writer.write(self._secret)
            self._conn = _Connection(reader, writer, self._name)
            self._connecting.set_result(self._conn)
            return self._conn
        except BaseException as e:
            self._connecting.set_exception(e)
            self._connecting.exception()  # retrieved: a later call retries
            raise
        finally:
            self._connecting = None

    async def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the actor; its result, or its exception raised here."""
        conn = await self._connection()
        rid = self._ids()
        fut = asyncio.get_running_loop().create_future()
        conn.pending[rid] = fut
        try:
            await self._write(conn, (rid, method, args))
            return await fut
        finally:
            conn.pending.pop(rid, None)

    async def send(self, method: str, *args: Any) -> None:
        """``method(*args)`` on the actor without waiting for (or getting) its answer."""
        await self._write(await self._connection(), (_NO_REPLY, method, args))

    async def _write(self, conn: _Connection, message: tuple) -> None:
        conn.writer.writelines(_frame(message))
        try:
            await conn.writer.drain()
        except ConnectionError as e:
            raise PeerLost(f"lost the connection to {self._name} ({type(e).__name__}: {e})") from None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.writer.close()
            self._conn.reader_task.cancel()
            self._conn = None
