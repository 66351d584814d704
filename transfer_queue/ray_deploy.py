"""The Ray deployment: the controller and each storage unit are Ray actors.

    client ──reserve/commit/get_batch/ack (metadata, msgspec)──► ControllerActor
       │                                                          │ free(indices) on ack/drop
       └──put/get Packed rows (numpy buffers, object store)──► StorageActor × N

Sample data never passes through the controller: the client packs the rows of
each storage unit into a few flat numpy buffers, which Ray moves through its
object store without pickling a Python object per token; the storage unit keeps
zero-copy views of them. The client (a TransferQueue holding actor handles)
pickles, so rollout and trainer actors in other processes can share one queue.

Ray is imported only when this deployment is chosen, and must already be
initialized: the queue joins the running Ray, it never starts (or stops) one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import ray

import loop
from transfer_queue.codec import pack_rows, unpack_rows
from transfer_queue.config import TransferQueueConfig
from transfer_queue.controller import Controller
from transfer_queue.deploy_local import _shard
from transfer_queue.storage import StorageUnit
from transfer_queue.wire import QueueStats

__all__ = ["RayDeployment"]


@ray.remote
class StorageActor:
    """One storage unit in its own process. An async actor: its methods run one
    at a time on the actor's loop (none awaits while touching the rows)."""

    def __init__(self, unit_id: int) -> None:
        self._unit = StorageUnit(unit_id)
        self._controller: Any = None

    def ready(self, controller: Any) -> int:
        self._controller = controller
        return self._unit.unit_id

    def put(self, packed: Any) -> None:
        self._unit.put_packed(packed)

    async def put_commit(self, packed: Any, all_indices: list[int], tags: list[Any]) -> None:
        """Store the rows, then commit them at the controller: one client message per write."""
        self._unit.put_packed(packed)
        await self._controller.commit_after.remote(all_indices, tags)

    def get(self, indices: list[int], fields: Sequence[str] | None) -> Any:
        return self._unit.get_packed(indices, fields)

    def delete(self, indices: list[int]) -> None:
        self._unit.delete(indices)

    def num_rows(self) -> int:
        return len(self._unit)


@ray.remote
class ControllerActor:
    """The controller in its own process (an async actor: waiting gets and puts
    each hold a coroutine, not a thread)."""

    def __init__(self, cfg: TransferQueueConfig, units: list[Any]) -> None:
        self._cfg, self._units = cfg, units
        self._controller: Controller | None = None

    async def setup(self) -> None:
        loop.adopt()  # Ray's loop is this process's one loop
        self._controller = Controller(self._cfg, free=self._free)

    async def call(self, method: str, *args: Any) -> Any:
        result = getattr(self._controller, method)(*args)
        if asyncio.iscoroutine(result):
            result = await result
        return result

    async def commit_after(self, indices: list[int], tags: list[Any], *_written: None) -> None:
        """commit, once the storage writes passed in (as ObjectRefs) are done: Ray
        resolves them before this runs, so the client waits on one reply, not N+1."""
        await self._controller.commit(indices, tags)

    async def _free(self, indices: list[int]) -> None:
        # Fire and forget: global indices are never reused, so a late delete can
        # never hit a newer row, and ack need not wait for the storage round trip.
        for unit, (idx, _) in _shard(indices, indices, len(self._units)).items():
            self._units[unit].delete.remote(idx)


class RayDeployment:
    """Client side of the Ray deployment: actor handles only, so it pickles."""

    def __init__(self, controller: Any, units: list[Any], owner: bool) -> None:
        self._controller, self.units, self._owner = controller, units, owner

    @classmethod
    async def create(cls, cfg: TransferQueueConfig) -> RayDeployment:
        if not ray.is_initialized():
            raise RuntimeError("deployment='ray' joins a running Ray; call ray.init(...) first")
        units = [StorageActor.options(num_cpus=cfg.ray_num_cpus).remote(i) for i in range(cfg.num_storage_units)]
        controller = ControllerActor.options(num_cpus=cfg.ray_num_cpus).remote(cfg, units)
        await _unwrap(asyncio.gather(controller.setup.remote(), *(u.ready.remote(controller) for u in units)))
        return cls(controller, units, owner=True)

    def __reduce__(self) -> tuple:
        return (RayDeployment, (self._controller, self.units, False))  # copies never kill the actors

    async def call(self, method: str, *args: Any) -> Any:
        return await _unwrap(self._controller.call.remote(method, *args))

    async def write_commit(
        self, indices: Sequence[int], rows: Sequence[dict[str, Any]], all_indices: list[int], tags: list[Any]
    ) -> None:
        shards = _shard(indices, rows, len(self.units))
        if len(shards) == 1:  # the usual case: a put's new samples share one unit
            ((u, (idx, part)),) = shards.items()
            await _unwrap(self.units[u].put_commit.remote(pack_rows(idx, part), all_indices, tags))
            return
        puts = [self.units[u].put.remote(pack_rows(idx, part)) for u, (idx, part) in shards.items()]
        await _unwrap(self._controller.commit_after.remote(all_indices, tags, *puts))

    async def read(self, indices: Sequence[int], fields: Sequence[str] | None) -> list[dict[str, Any]]:
        n = len(self.units)
        shards = _shard(range(len(indices)), indices, n, key=indices)
        fields = list(fields) if fields is not None else None
        packs = await _unwrap(asyncio.gather(*(self.units[u].get.remote(idx, fields) for u, (_, idx) in shards.items())))
        rows: list[dict[str, Any] | None] = [None] * len(indices)
        for (positions, _), packed in zip(shards.values(), packs):
            for pos, row in zip(positions, unpack_rows(packed)):
                rows[pos] = row
        return rows  # type: ignore[return-value]

    def statistics(self) -> QueueStats:
        return ray.get(self._controller.call.remote("statistics"))

    async def shutdown(self) -> None:
        """Kill the actors (only from the client that created them)."""
        if self._owner:
            for actor in (self._controller, *self.units):
                ray.kill(actor)


async def _unwrap(awaitable: Any) -> Any:
    """Await a Ray call; an error raised in the actor surfaces as itself, not wrapped."""
    try:
        return await awaitable
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise
