"""TransferQueue: the client every producer and consumer holds.

    producers ── put / put_fields ──► controller.reserve ─► storage units (rows) ─► controller.commit
                 (under Ray a put of new samples is one client call: its rows go to a storage
                  unit, which has the controller reserve and commit them, in the client's index block)
    consumers ── get ──► controller.get_batch (leases) ─► storage units (rows) ─► Batch
              ── ack / nack ──► controller (frees storage rows on ack)

One API over two deployments (``cfg.deployment``): ``"local"`` keeps controller
and storage units in this process; ``"ray"`` makes them Ray actors and moves
data client <-> storage unit directly. Every async method has a ``*_sync`` twin
for notebooks and scripts, run on the process's one loop (``loop.run``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import loop
from transfer_queue.batch import Batch
from transfer_queue.codec import ALL_FIELDS, FULL_MASK, encode_new_rows, fields_mask, mask_fields, sample_to_row, tags_of
from transfer_queue.coalesce import PutCoalescer, ReserveRefused
from transfer_queue.config import TransferQueueConfig
from transfer_queue.deploy_local import LocalDeployment, reserve_write_commit
from contracts.sample import Sample
from transfer_queue.wire import QueueStats, SampleTags, Snapshot

__all__ = ["TransferQueue"]


class TransferQueue:
    """A client of one TransferQueue deployment. Build it with ``create`` (or ``load``)."""

    def __init__(self, cfg: TransferQueueConfig, deployment: Any) -> None:
        self.cfg = cfg
        self._d = deployment
        # Across processes a put costs round trips: concurrent puts share them.
        self._coalescer = PutCoalescer(self._reserve_write_commit) if cfg.deployment == "ray" else None

    def __getstate__(self) -> dict[str, Any]:  # to another process: the handles, not our queued puts
        return {"cfg": self.cfg, "_d": self._d}

    def __setstate__(self, state: dict[str, Any]) -> None:
        TransferQueue.__init__(self, state["cfg"], state["_d"])

    # ---------------------------------------------------------------- creation
    @classmethod
    async def create(cls, cfg: TransferQueueConfig | None = None, *, clock: Callable[[], float] | None = None,
                     ray_options: dict[str, Any] | None = None) -> TransferQueue:
        """Start a deployment of ``cfg`` and return its client.

        ``clock`` (local deployment only) times leases; tests pass a fake one.
        Under ``deployment="ray"`` Ray must already be initialized (``ray.init``);
        ``ray_options`` places its actors (``RayDeployment.create``'s keywords).
        """
        cfg = cfg or TransferQueueConfig()
        if cfg.deployment == "local":
            return cls(cfg, LocalDeployment(cfg, clock=clock or time.monotonic))
        if clock is not None:
            raise ValueError("clock= is only for deployment='local'")
        from transfer_queue.ray_deploy import RayDeployment

        return cls(cfg, await RayDeployment.create(cfg, **(ray_options or {})))

    @classmethod
    def create_sync(cls, cfg: TransferQueueConfig | None = None) -> TransferQueue:
        return loop.run(cls.create(cfg))

    # -------------------------------------------------------------- producers
    async def put(
        self, samples: Sequence[Sample], partition: str = "train", wait: bool = True, timeout_s: float | None = None
    ) -> None:
        """Add whole new samples (every field ready at once).

        Waits while the queue is at capacity; with ``wait=False`` raises QueueFull
        instead, and a finite ``timeout_s`` raises TimeoutError. A uid already in
        the queue is a ValueError. After ``close()`` raises QueueClosed. It returns
        once the samples are stored and committed (a ``get`` can hand them out).
        """
        await self._write(samples, ALL_FIELDS, partition, wait, timeout_s, new_only=True)

    async def put_fields(
        self,
        samples: Sequence[Sample],
        fields: Sequence[str],
        partition: str = "train",
        wait: bool = True,
        timeout_s: float | None = None,
    ) -> None:
        """Write only ``fields`` of ``samples``, matched by uid (e.g. the prompt first, the response later).

        A uid not yet in the queue is registered (counts against capacity and as
        ``put``); a known one gets these fields added or replaced. A sample is
        handed out only once every field the get asks for is written.
        """
        if not fields:
            raise ValueError("put_fields needs at least one field")
        await self._write(samples, tuple(fields), partition, wait, timeout_s, new_only=False)

    async def _write(
        self, samples: Sequence[Sample], fields: tuple[str, ...], partition: str, wait: bool, timeout_s: float | None, new_only: bool
    ) -> None:
        if not samples:
            return
        key = (partition, fields, wait, timeout_s, new_only)
        if new_only and getattr(self._d, "encoded_put", False):  # another process: encoded now (the copy), one call
            body, row_ends, tags = encode_new_rows(samples)
            if self._coalescer is not None:  # Ray: one write with its neighbours
                await self._coalescer.put(key, [(body, row_ends)], tags)
                return
            try:
                await self._d.put_new(partition, [(body, row_ends)], tags, wait, timeout_s)
            except ReserveRefused as e:
                raise e.cause from None
            return
        mask = fields_mask(fields)
        rows = [sample_to_row(s, fields) for s in samples]
        tags = [tags_of(r, mask) for r in rows]
        if self._coalescer is None:
            try:
                await self._reserve_write_commit(key, rows, tags)
            except ReserveRefused as e:
                raise e.cause from None
        else:
            await self._coalescer.put(key, rows, tags)

    async def _reserve_write_commit(self, key: tuple, rows: list[Any], tags: list[SampleTags]) -> None:
        partition, _, wait, timeout_s, new_only = key
        if new_only and getattr(self._d, "encoded_put", False):  # rows: (msgpack rows, row ends), in one call
            await self._d.put_new(partition, rows, tags, wait, timeout_s)
            return
        await reserve_write_commit(self._d, partition, rows, tags, new_only, wait, timeout_s)

    async def drop(self, uids: Sequence[str], reason: str) -> int:
        """Remove pending samples by uid, counted under ``reason``. All or nothing:
        an unknown uid is a LookupError, a leased one a RuntimeError."""
        return await self._d.call("drop", list(uids), reason)

    # -------------------------------------------------------------- consumers
    async def get(
        self,
        consumer: str,
        batch_size: int,
        partition: str = "train",
        sampler: str = "sequential",
        group_size: int = 1,
        current_version: int | None = None,
        max_staleness: int | None = None,
        timeout_s: float | None = None,
        fields: Sequence[str] | None = None,
        group_ids: Sequence[str] | None = None,
    ) -> Batch:
        """Lease ``batch_size`` samples for ``consumer`` once they are ready.

        ``sampler``: ``"sequential"`` (FIFO) or ``"grpo_group"`` (whole groups of
        ``group_size``; ``batch_size`` a multiple of it). With ``current_version``
        and ``max_staleness``, samples with ``current_version - min_version >
        max_staleness`` are dropped first (reason ``"stale"``; with grpo_group
        their group too, ``"stale_group"``), counted in ``Batch.dropped`` and stats.
        ``fields`` (default: all) are the fields a sample needs to be ready and
        the ones returned. Blocks until ready; ``timeout_s`` bounds the wait
        (TimeoutError), ``timeout_s=0`` polls (QueueEmpty). After ``close()``,
        batches still formable are handed out, then EndOfStream.
        ``group_ids`` (grpo_group only; ``batch_size == len(group_ids) * group_size``):
        exactly these groups, whole, in this order; RuntimeError for one the queue
        dropped (stale, or lost with a storage unit).
        The batch must be ``ack``-ed within ``cfg.lease_s`` or it is redelivered.
        """
        mask = fields_mask(fields)
        meta = await self._d.call(
            "get_batch", partition, consumer, batch_size, sampler, group_size, mask,
            current_version, max_staleness, timeout_s, None if group_ids is None else list(group_ids),
        )  # fmt: skip
        try:
            rows = await self._d.read(meta.indices, None if mask == FULL_MASK else mask_fields(mask))
        except BaseException:
            await self._d.call("nack", meta.batch_id)
            raise
        return Batch(meta.batch_id, rows, meta.dropped)

    async def get_nowait(self, consumer: str, batch_size: int, **kwargs: Any) -> Batch:
        """``get`` that never waits: QueueEmpty when no batch is ready."""
        return await self.get(consumer, batch_size, timeout_s=0, **kwargs)

    async def drop_stale(self, current_version: int, max_staleness: int, partition: str = "train",
                         whole_groups: bool = True) -> int:
        """Drop now what a ``get`` with these bounds would drop first (reasons ``"stale"``,
        ``"stale_group"`` with ``whole_groups``); returns the number of samples dropped."""
        return await self._d.call("drop_stale", partition, current_version, max_staleness, whole_groups)

    async def pending_groups(self, partition: str = "train") -> list[tuple[str, int, int]]:
        """(group id, samples, oldest token version) of each group with samples waiting
        (not leased), in the arrival order of each group's first sample."""
        return [tuple(g) for g in await self._d.call("pending_groups", partition)]

    async def ack(self, batch_id: str) -> int:
        """The batch was consumed: its samples are delivered and freed. LeaseLost if not leased."""
        return await self._d.call("ack", batch_id)

    async def nack(self, batch_id: str) -> int:
        """Hand the batch back: its samples are ready for the next get at once."""
        return await self._d.call("nack", batch_id)

    async def extend_lease(self, batch_id: str) -> None:
        """Restart the lease of a batch still being worked on (a long training step)."""
        await self._d.call("extend_lease", batch_id)

    async def expire_leases(self, force: bool = False) -> int:
        """Return leases past their deadline now (every lease with ``force``: as if
        their consumers died); returns the number of samples made ready again."""
        return await self._d.call("expire_leases", force)

    # -------------------------------------------------------------- lifecycle
    def statistics(self) -> QueueStats:
        """Counters now. Under Ray this blocks on the controller: in coroutines prefer ``statistics_async``."""
        return self._d.statistics()

    async def statistics_async(self) -> QueueStats:
        return await self._d.call("statistics")

    async def close(self) -> None:
        """End of input: later puts raise QueueClosed; getters drain, then get EndOfStream."""
        await self._d.call("close")

    async def shutdown(self) -> None:
        """Close and release the deployment (Ray actors are killed; local rows freed)."""
        try:
            await self.close()
        finally:
            await self._d.shutdown()

    async def save(self, path: str) -> Snapshot:
        """Persist unsettled samples (pending and in flight) and counters; see ``persist.py``.
        Returns the counters saved."""
        from transfer_queue.persist import save

        return await save(self, path)

    async def restore(self, path: str) -> Snapshot:
        """Put what ``save`` wrote into this queue (running, never written to):
        samples back in arrival order, leased ones ready again, then the counters."""
        from transfer_queue.persist import restore

        return await restore(self, path)

    @classmethod
    async def load(cls, path: str, cfg: TransferQueueConfig | None = None) -> TransferQueue:
        """A new queue of ``cfg`` holding what ``save`` wrote; leased samples come back ready."""
        from transfer_queue.persist import load

        return await load(cls, path, cfg or TransferQueueConfig())

    # ---------------------------------------------------------- synchronous twins
    def put_sync(self, samples: Sequence[Sample], partition: str = "train", wait: bool = True, timeout_s: float | None = None) -> None:
        loop.run(self.put(samples, partition, wait, timeout_s))

    def put_fields_sync(self, samples: Sequence[Sample], fields: Sequence[str], partition: str = "train") -> None:
        loop.run(self.put_fields(samples, fields, partition))

    def get_sync(self, consumer: str, batch_size: int, **kwargs: Any) -> Batch:
        return loop.run(self.get(consumer, batch_size, **kwargs))

    def ack_sync(self, batch_id: str) -> int:
        return loop.run(self.ack(batch_id))

    def nack_sync(self, batch_id: str) -> int:
        return loop.run(self.nack(batch_id))

    def drop_sync(self, uids: Sequence[str], reason: str) -> int:
        return loop.run(self.drop(uids, reason))

    def close_sync(self) -> None:
        loop.run(self.close())

    def shutdown_sync(self) -> None:
        loop.run(self.shutdown())

    def save_sync(self, path: str) -> Snapshot:
        return loop.run(self.save(path))

    @classmethod
    def load_sync(cls, path: str, cfg: TransferQueueConfig | None = None) -> TransferQueue:
        return loop.run(cls.load(path, cfg))
