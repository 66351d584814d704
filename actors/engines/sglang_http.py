"""HTTP/1.1 as the SGLang engine (:mod:`actors.engines.sglang_engine`) speaks it to
an SGLang server: one connection per call, ``Connection: close``, JSON bodies,
answers read whole, chunked, sized or to the end of the connection, and
``/generate``'s server-sent events. Needs no HTTP package: asyncio streams only.

    call(method, path, body)        one request; its body (HTTP 200, else SglangServerError)
    send(...) -> SglangResponse     a request sent, its answer not read yet (a stream that
                                    pause / abort can cut: resp.cut())
    open(...) -> SglangResponse     the same, with its status line and headers read
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

import msgspec

__all__ = ["SglangHttp", "SglangResponse", "SglangServerError"]


class SglangServerError(RuntimeError):
    """The SGLang server could not be reached, did not answer in time, or answered
    with an error. The message names the server's URL and the call."""


class SglangResponse:
    """A response's status and headers, its body read piece by piece (chunked,
    sized or to the end) and, for ``/generate``, as server-sent events."""

    def __init__(self, http: SglangHttp, what: str, timeout_s: float, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.http, self.what, self.timeout_s = http, what, timeout_s
        self.reader, self.writer = reader, writer
        self.status, self.headers = 0, {}
        self._chunked = False
        self._left = -1  # the body's size when it is given; -1: chunked or up to the end
        self._ended = False
        self._buffer = b""

    async def _io(self, aw: Awaitable[T]) -> T:
        return await self.http.io(aw, self.what, self.timeout_s)

    async def read_head(self) -> None:
        line = await self._io(self.reader.readline())
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise SglangServerError(f"the SGLang server at {self.http.url} answered {self.what} with no HTTP "
                                    f"status line: {line[:80]!r}")
        self.status = int(parts[1])
        while (line := await self._io(self.reader.readline())) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            self.headers[key.strip().lower()] = value.strip()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        if not self._chunked and "content-length" in self.headers:
            self._left = int(self.headers["content-length"])

    async def piece(self) -> bytes:
        """The next piece of the body; ``b""`` at its end."""
        if self._ended:
            return b""
        if self._chunked:
            line = await self._io(self.reader.readline())
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise SglangServerError(f"the SGLang server at {self.http.url} broke off its answer to "
                                        f"{self.what} (chunk header {line[:40]!r})") from None
            data = await self._io(self.reader.readexactly(size + 2)) if size else b""
            self._ended = size == 0
            return data[:size]
        if self._left >= 0:
            data = await self._io(self.reader.readexactly(self._left)) if self._left else b""
            self._ended = True
            return data
        data = await self._io(self.reader.read(65536))
        self._ended = not data
        return data

    async def body(self) -> bytes:
        pieces = []
        while piece := await self.piece():
            pieces.append(piece)
        return b"".join(pieces)

    async def event(self) -> Any:
        """The next server-sent event's JSON; ``None`` after ``data: [DONE]``."""
        while True:
            event, sep, rest = self._buffer.partition(b"\n\n")
            if sep:
                self._buffer = rest
                for line in event.splitlines():
                    if line.startswith(b"data:"):
                        payload = line[5:].strip()
                        return None if payload == b"[DONE]" else msgspec.json.decode(payload)
                continue
            piece = await self.piece()
            if not piece:
                raise SglangServerError(f"the SGLang server at {self.http.url} ended its answer to {self.what} "
                                        f"before 'data: [DONE]'")
            self._buffer += piece

    def close(self) -> None:
        self.writer.close()

    def cut(self) -> None:
        """Drop the connection now: a read waiting on it sees its end."""
        self.writer.transport.abort()


class SglangHttp:
    """A client of the SGLang server at ``url``: one connection per call; every wait
    bounded by ``timeout_s`` (or the call's own), every failure a :class:`SglangServerError`."""

    def __init__(self, url: str, timeout_s: float) -> None:
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout_s = u.hostname, u.port, timeout_s
        self.url = f"http://{self.host}:{self.port}"

    async def io(self, aw: Awaitable[T], what: str, timeout_s: float) -> T:
        try:
            async with asyncio.timeout(timeout_s):
                return await aw
        except TimeoutError:  # before OSError: TimeoutError is one
            raise SglangServerError(f"the SGLang server at {self.url} did not answer {what} "
                                    f"within {timeout_s:g} s") from None
        except (OSError, asyncio.IncompleteReadError) as err:
            raise SglangServerError(f"the connection to the SGLang server at {self.url} broke during "
                                    f"{what}: {err!r}") from None

    async def send(self, method: str, path: str, body: object = None, timeout_s: float | None = None) -> SglangResponse:
        """Connect and send a request; the response's head is not read yet."""
        what, timeout_s = f"{method} {path}", timeout_s or self.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(self.host, self.port)
        except (TimeoutError, OSError) as err:
            why = f"no connection within {timeout_s:g} s" if isinstance(err, TimeoutError) else str(err)
            raise SglangServerError(f"cannot connect to the SGLang server at {self.url} ({what}): {why}; "
                                    f"is it running? (rollout.engine.url)") from None
        data = b"" if body is None else msgspec.json.encode(body)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nConnection: close\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        return SglangResponse(self, what, timeout_s, reader, writer)

    async def open(self, method: str, path: str, body: object = None, timeout_s: float | None = None) -> SglangResponse:
        """Send a request; return the response with its head read."""
        resp = await self.send(method, path, body, timeout_s)
        try:
            await resp.read_head()
        except BaseException:
            resp.cut()
            raise
        return resp

    async def call(self, method: str, path: str, body: object = None, timeout_s: float | None = None) -> bytes:
        """One request; its body. Raises :class:`SglangServerError` unless HTTP 200."""
        resp = await self.open(method, path, body, timeout_s)
        try:
            data = await resp.body()
        finally:
            resp.close()
        if resp.status != 200:
            raise SglangServerError(f"the SGLang server at {self.url} answered {resp.what} with HTTP "
                                    f"{resp.status}: {data[:500].decode('utf-8', 'replace')}")
        return data
