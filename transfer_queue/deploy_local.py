"""The in-process deployment: controller and storage units are objects in this process.

The default for one machine and for tests. Calls are direct (no copies, no
serialization); the data path is the same as under Ray: rows sharded by
``global index % num_storage_units``, the controller never touches them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from transfer_queue.coalesce import ReserveRefused
from transfer_queue.config import TransferQueueConfig
from transfer_queue.controller import Controller
from transfer_queue.rows import InProcessRows
from transfer_queue.storage import StorageUnit
from transfer_queue.wire import QueueStats, SampleTags

__all__ = ["LocalDeployment"]


class LocalDeployment:
    """Controller + storage units in this process, behind the deployment interface.

    The interface every deployment has (the client uses nothing else):
    ``call`` a controller method, ``write_commit``/``read`` rows by global index,
    ``statistics``, ``shutdown``. A deployment in other processes also takes new
    samples whole, encoded, in one call: ``put_new`` (``encoded_put``).
    """

    def __init__(self, cfg: TransferQueueConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.units = [StorageUnit(i) for i in range(cfg.num_storage_units)]
        self.controller = Controller(cfg, free=self._free, clock=clock)

    def __reduce__(self) -> tuple:
        # A copy in another process would be a second, empty queue that nobody reads.
        raise TypeError("a TransferQueue of the in-process deployment cannot be sent to another process; "
                        "serve it (transfer_queue.served.QueueHost) or use deployment='ray'")

    async def call(self, method: str, *args: Any) -> Any:
        # A checkpoint, as anyio's memory streams have: a consumer whose batches
        # are always ready must not starve the producers and other consumers.
        await asyncio.sleep(0)
        result = getattr(self.controller, method)(*args)
        if hasattr(result, "__await__"):
            result = await result
        return result

    async def write(self, indices: Sequence[int], rows: Sequence[dict[str, Any]]) -> None:
        n = len(self.units)
        if n == 1:
            self.units[0].put_rows(indices, rows)
            return
        for unit, (idx, part) in _shard(indices, rows, n).items():
            self.units[unit].put_rows(idx, part)

    async def write_commit(
        self, indices: Sequence[int], rows: Sequence[dict[str, Any]], all_indices: list[int], tags: list[SampleTags]
    ) -> None:
        """Store the rows, then commit their tags (``all_indices`` may hold -1: dropped on arrival)."""
        await self.write(indices, rows)
        await self.controller.commit(all_indices, tags)

    async def put_new(self, partition: str, rows: list[dict[str, Any]], tags: list[SampleTags], wait: bool,
                      timeout_s: float | None) -> list[int]:
        """New samples' rows registered, stored and committed in one go (a served queue
        host's ``put_new``); returns their indices (-1: dropped on arrival)."""
        return await reserve_write_commit(self, partition, rows, tags, True, wait, timeout_s)

    async def read(self, indices: Sequence[int], fields: Sequence[str] | None) -> InProcessRows:
        n = len(self.units)
        if n == 1:
            return InProcessRows(self.units[0].get_rows(indices, fields))
        # Each unit's rows in batch order, then interleaved back: comprehensions, no per-row dict work.
        parts = [iter(unit.get_rows([i for i in indices if i % n == u], fields)) for u, unit in enumerate(self.units)]
        return InProcessRows([next(parts[i % n]) for i in indices])

    def statistics(self) -> QueueStats:
        return self.controller.statistics()

    async def shutdown(self) -> None:
        for unit in self.units:
            unit.clear()

    async def _free(self, indices: list[int]) -> None:
        n = len(self.units)
        for unit, (idx, _) in _shard(indices, indices, n).items():
            self.units[unit].delete(idx)


async def reserve_write_commit(d: Any, partition: str, rows: Sequence[dict[str, Any]], tags: list[SampleTags],
                               new_only: bool, wait: bool, timeout_s: float | None) -> list[int]:
    """A write through deployment ``d``: the controller registers the rows' samples
    (``reserve``; a refusal raises ``ReserveRefused``: nothing registered), the rows go to
    the storage units and their fields are marked ready (``write_commit``). A write that
    fails drops new samples (``new_only``), counted ``write_failed``, and re-raises.
    Returns the indices (-1: dropped on arrival)."""
    try:
        indices = await d.call("reserve", partition, tags, new_only, wait, timeout_s)
    except Exception as e:  # nothing was registered
        raise ReserveRefused(e) from None
    kept = [i for i, index in enumerate(indices) if index >= 0]  # -1: dropped on arrival, counted
    try:  # rows to the storage units, then the fields are marked ready (commit)
        await d.write_commit([indices[i] for i in kept], [rows[i] for i in kept], indices, tags)
    except BaseException:
        if new_only:  # nothing of these samples is readable: drop them, counted, and re-raise
            await d.call("drop", [tags[i].uid for i in kept], "write_failed")
        raise
    return indices


def _shard(a: Sequence, b: Sequence, n: int, key: Sequence[int] | None = None) -> dict[int, tuple[list, list]]:
    """Split parallel sequences ``a``, ``b`` by storage unit of ``key`` (default ``a``) % n."""
    out: dict[int, tuple[list, list]] = {}
    for k, x, y in zip(key if key is not None else a, a, b):
        part = out.get(k % n)
        if part is None:
            part = out[k % n] = ([], [])
        part[0].append(x)
        part[1].append(y)
    return out
