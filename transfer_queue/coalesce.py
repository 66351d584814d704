"""Group commit: concurrent puts of one client share one reserve / write / commit.

Across processes each put costs calls (under Ray, a put of new samples is one
client call: rows to a storage unit, which has the controller reserve and
commit them; ``put_fields`` is reserve, write, commit). A rollout actor finishes many samples at
once, so while one put of a client is in flight, the puts that arrive behind it
(same partition, fields and options) wait and then go as one. No timer is
involved: a put on an idle client goes on the next loop tick (so puts issued in
the same tick, e.g. by producers one write woke together, share it), so
coalescing adds no latency, only saves messages when there is a queue of them.

Errors stay per put: when a merged reserve is refused (a bad uid in one put,
QueueFull, a timeout), nothing was registered, so each put is retried alone and
gets its own answer. A failure after reserve (a storage write) is reported to
every put of the group; their samples were dropped with reason "write_failed"
(a Ray put of new samples whose unit died registered nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


__all__ = ["PutCoalescer", "ReserveRefused"]


class ReserveRefused(Exception):
    """Raised by the write function when the controller refused the reserve (nothing registered)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause

    def __reduce__(self) -> tuple:  # a storage actor raises it to the client (pickled, see rpc.py)
        return (ReserveRefused, (self.cause,))


Write = Callable[[tuple, list, list], Awaitable[None]]


class PutCoalescer:
    """Runs ``write(key, rows, tags)``; puts with the same key that queue up meanwhile are merged."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self._busy: set[tuple] = set()
        self._queued: dict[tuple, list[tuple[list, list, asyncio.Future]]] = {}
        self._tasks: set[asyncio.Task] = set()

    async def put(self, key: tuple, rows: list, tags: list) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._queued.setdefault(key, []).append((rows, tags, fut))
        if key not in self._busy:
            self._busy.add(key)
            # The write starts on the next loop tick, so puts issued in this tick
            # (producers woken together by the last write) join it.
            self._start(key)
        await fut

    def _start(self, key: tuple) -> None:
        task = asyncio.get_running_loop().create_task(self._flush(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_one(self, key: tuple, rows: list, tags: list) -> None:
        try:
            await self._write(key, rows, tags)
        except ReserveRefused as e:
            raise e.cause from None

    async def _flush(self, key: tuple) -> None:
        group = self._queued.pop(key)
        try:
            rows = [r for g in group for r in g[0]]
            tags = [t for g in group for t in g[1]]
            try:
                await self._write(key, rows, tags)
                _settle(group, None)
            except ReserveRefused as e:
                if len(group) == 1:
                    _settle(group, e.cause)
                else:  # someone's bad input or no room for all: each put alone
                    for one in group:
                        try:
                            await self._write_one(key, one[0], one[1])
                            _settle([one], None)
                        except Exception as err:  # handed to that put's caller
                            _settle([one], err)
            except Exception as err:  # handed to every caller of the group
                _settle(group, err)
        except asyncio.CancelledError:  # the loop is going away: so are the callers
            for _, _, fut in group:
                fut.cancel()
            raise
        finally:
            if key in self._queued:  # puts that arrived during this write go next, as one
                self._start(key)
            else:
                self._busy.discard(key)


def _settle(group: list[tuple[list, list, asyncio.Future]], error: BaseException | None) -> None:
    for _, _, fut in group:
        if fut.done():  # its caller was cancelled; the samples went in anyway
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)


