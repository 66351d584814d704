"""The controller: every sample's metadata, no sample data.

Per partition it knows which samples exist (by uid and global index), which of
their fields are ready (a bit mask), which are leased to which consumer, and
each sample's tags (group id, weight versions, lengths). Storage units hold the
data under the same global index; the controller only tells them what to free.

A write is two-phase so data never goes through the controller:

    reserve(tags) -> global indices      waits for capacity; registers new uids
    (client writes the rows to storage units index % num_units)
    commit(indices, tags)                marks the written fields ready; wakes getters

    get_batch -> BatchMeta  (leases the picked samples)  -> ack | nack | lease expiry

Delivery is exactly-once across all consumers of a partition: a sample goes to
one consumer at a time and leaves the queue when that consumer acks it.
Every state change sets ``_changed`` (and replaces it), which wakes each waiter
to re-check its own condition; close() does the same, so no waiter sleeps forever.
The running totals that statistics report and snapshots save (put, delivered,
dropped by reason, per consumer) are kept in ``transfer_queue.counters``.

Its seams are modules of their own, each a part it holds:

    transfer_queue.table       SampleTable  every resident sample's record, the pending ones in arrival order
    transfer_queue.units       UnitMap      where new samples go; storage units lost and replaced
    transfer_queue.leases      LeaseBook    the batches leased out, their deadlines and timers
    transfer_queue.staleness   Staleness    what a get drops as stale; dead and lost groups
    transfer_queue.counters    QueueCounters  the running totals

A storage unit whose actor died (Ray: its node was lost) is reported with
``unit_lost``: the samples it held are dropped, counted (``"storage_lost"``),
and new samples go to the other units until ``unit_replaced`` says a new actor
serves it; it then takes new samples again, in slots above the lost ones.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import cast

from transfer_queue.codec import FULL_MASK
from transfer_queue.config import TransferQueueConfig
from transfer_queue.counters import QueueCounters
from transfer_queue.errors import EndOfStream, QueueClosed, QueueEmpty, QueueFull
from transfer_queue.leases import LeaseBook
from transfer_queue.records import Lease, Record
from transfer_queue.samplers import SAMPLERS, Candidate, Sampler, named_groups
from transfer_queue.staleness import VERSIONS_BIT, Staleness
from transfer_queue.table import SampleTable
from transfer_queue.units import UnitMap
from transfer_queue.wire import BatchMeta, PartitionStats, QueueStats, SampleTags, Snapshot

__all__ = ["Controller"]


class Controller:
    """Metadata, readiness, leases and counters of one TransferQueue.

    ``free(indices)`` is called with the global indices whose data the storage
    units may drop (acked or dropped samples). ``clock`` times leases (monotonic
    seconds); tests pass a fake one and call ``expire_leases``.
    """

    def __init__(
        self,
        cfg: TransferQueueConfig,
        free: Callable[[list[int]], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg, self._free = cfg, free
        self._table = SampleTable()
        self._counts = QueueCounters()  # put, delivered, redelivered, dropped; per consumer
        self._units = UnitMap(cfg.num_storage_units)
        self._leases = LeaseBook(cfg.lease_s, clock, on_due=self.expire_leases)
        self._stale = Staleness()
        self._closed = False
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ writes
    async def reserve(
        self,
        partition: str,
        tags: list[SampleTags],
        new_only: bool,
        wait: bool = True,
        timeout_s: float | None = None,
        indices: list[int] | None = None,
        commit: bool = False,
    ) -> list[int]:
        """Global index per tag (-1: dropped on arrival, its group is dead); waits for capacity.

        ``indices``: the global index of each (new) sample, from a block the caller
        got from ``allocate`` (default: the next slots of one storage unit, round
        robin over puts). ``commit``: mark the tags' fields ready at once: the
        caller is writing the rows to the storage unit concurrently, and the unit
        holds a read of an index back until its row arrives (see ``ray_deploy``).
        """
        await self._wait_for_room(partition, tags, new_only, wait, timeout_s)
        self._table.pending.setdefault(partition, {})
        if indices is None:
            unit = self._units.next_unit()
            placed = self._register(partition, tags, lambda _: self._units.take_index(unit))
        else:
            assert new_only and len(indices) == len(tags), "placed indices are for whole new samples"
            if indices:
                self._units.check_block(indices[0])  # a block's indices share a unit
            placed = self._register(partition, tags, indices.__getitem__)
        if commit:
            orphans = self._table.mark_written(placed, tags, self._stale.lower_floor)
            assert not orphans, "just reserved: nothing can have dropped them"
            self._notify()
        return placed

    def allocate(self, unit: int, num_slots: int) -> int:
        """Hand a client the next ``num_slots`` slots of storage unit ``unit``; returns the first.

        Slot ``k`` is global index ``k * num_storage_units + unit``. A client places its
        new samples in its own block (``reserve(indices=...)``), so it can write their
        rows to the unit while the controller registers them: a put is one round trip.
        Indices are never reused, so a block's unused slots are simply skipped.
        """
        return self._units.allocate(unit, num_slots)

    async def _wait_for_room(
        self, partition: str, tags: list[SampleTags], new_only: bool, wait: bool, timeout_s: float | None
    ) -> None:
        """Return once the write is valid and its new samples fit (QueueFull, TimeoutError if not)."""
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        while True:
            if self._closed:
                raise QueueClosed("put on a closed TransferQueue")
            num_new = self._table.check_write(partition, tags, new_only)
            if num_new > self._cfg.capacity:
                raise ValueError(f"put of {num_new} new samples exceeds capacity={self._cfg.capacity}")
            if len(self._table) + num_new <= self._cfg.capacity:
                return
            if not wait:
                raise QueueFull(f"{len(self._table)} of {self._cfg.capacity} samples resident; {num_new} more do not fit")
            if not await _wait(self._changed, deadline):
                raise TimeoutError(f"put waited {timeout_s}s for capacity")

    def _register(self, partition: str, tags: list[SampleTags], index_of: Callable[[int], int]) -> list[int]:
        """Each tag's global index: a new sample's from ``index_of(position)`` (-1: its group is dead)."""
        dead = self._stale.dead.get(partition, {})
        placed = []
        for i, t in enumerate(tags):
            rec = self._table.by_uid.get(t.uid)
            if rec is None:
                self._counts.num_put += 1
                if t.group_id in dead:
                    self._counts.dropped["stale_group"] += 1
                    placed.append(-1)
                    continue
                rec = self._table.add(partition, t, index_of(i))
            placed.append(rec.index)
        return placed

    async def commit(self, indices: list[int], tags: list[SampleTags]) -> None:
        """Mark the fields in ``tags`` ready for the written ``indices``; wake getters."""
        orphans = self._table.mark_written(indices, tags, self._stale.lower_floor)  # dropped meanwhile
        self._notify()
        if orphans:
            await self._release(orphans)

    async def drop(self, uids: list[str], reason: str) -> int:
        """Drop pending samples by uid, counted under ``reason``; all or nothing."""
        if not reason or not isinstance(reason, str):
            raise ValueError(f"drop reason must be a non-empty string, got {reason!r}")
        recs = []
        for uid in uids:
            rec = self._table.by_uid.get(uid)
            if rec is None:
                raise LookupError(f"uid {uid!r} is not in the queue (delivered, dropped or never put)")
            if rec.lease is not None:
                raise RuntimeError(f"uid {uid!r} is leased in batch {rec.lease!r}; nack it before dropping")
            recs.append(rec)
        if recs:
            await self._drop(recs, Counter({reason: len(recs)}))
        return len(recs)

    async def _drop(self, recs: list[Record], reasons: Counter[str]) -> None:
        self._table.settle(recs, "dropped")
        self._counts.dropped.update(reasons)
        self._notify()
        await self._release([r.index for r in recs])

    # ------------------------------------------------------------------- reads
    async def get_batch(
        self,
        partition: str,
        consumer: str,
        batch_size: int,
        sampler: str = "sequential",
        group_size: int = 1,
        mask: int = FULL_MASK,
        current_version: int | None = None,
        max_staleness: int | None = None,
        timeout_s: float | None = None,
        group_ids: Sequence[str] | None = None,
    ) -> BatchMeta:
        """Lease a batch for ``consumer`` once one can be formed; see ``TransferQueue.get``."""
        named = None if group_ids is None else list(group_ids)
        pick = _checked_sampler(sampler, named, batch_size, group_size, self._cfg.capacity)
        if (current_version is None) != (max_staleness is None) or (max_staleness or 0) < 0:
            raise ValueError("pass current_version and max_staleness >= 0 together (or neither)")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        dropped: Counter[str] = Counter()
        while True:
            changed = self._changed
            self.expire_leases()
            if self._leases.lost_returned:  # a lease that came back held samples of a lost unit
                await self._drop_lost()
            if current_version is not None and max_staleness is not None:
                await self._drop_stale(partition, current_version, max_staleness, sampler == "grpo_group", dropped)
            if named is not None:
                self._stale.check_alive(partition, named)
            pending = self._table.pending.get(partition, {})
            picked = None
            if len(pending) >= batch_size:  # every sampler needs that many: skip the scan each write wakes
                picked = pick((r for r in pending.values() if r.mask & mask == mask), batch_size, group_size)
            if picked is not None:  # the records it was given: a sampler only picks
                return self._lease(partition, consumer, cast("list[Record]", picked), mask, dropped)
            if self._closed:
                raise EndOfStream(f"partition {partition!r} is closed and cannot form a batch of {batch_size}")
            if timeout_s == 0:
                raise QueueEmpty(f"no batch of {batch_size} ready in partition {partition!r}")
            if not await _wait(changed, deadline):
                raise TimeoutError(f"no batch of {batch_size} ready in partition {partition!r} after {timeout_s}s")

    async def drop_stale(self, partition: str, current_version: int, max_staleness: int, whole_groups: bool) -> int:
        """Drop now what a get at ``current_version`` would drop as stale (counted the same
        way); returns how many samples. For a consumer that names its groups: the stale
        ones it skips hold queue room and admission slots until something drops them."""
        dropped: Counter[str] = Counter()
        await self._drop_stale(partition, current_version, max_staleness, whole_groups, dropped)
        return sum(dropped.values())

    def pending_groups(self, partition: str) -> list[tuple[str, int, int]]:
        """(group id, samples, oldest token version) of every group with unleased samples,
        in the arrival order of each group's first sample (a resumed consumer that names
        its groups takes them from here)."""
        return self._table.groups(partition)

    async def _drop_stale(
        self, partition: str, current_version: int, max_staleness: int, whole_groups: bool, dropped: Counter[str]
    ) -> None:
        pending = self._table.pending.get(partition, {})
        stale, reasons = self._stale.stale(partition, pending, current_version, max_staleness, whole_groups)
        if stale:
            dropped.update(reasons)
            await self._drop(stale, reasons)

    def _lease(self, partition: str, consumer: str, picked: list[Record], mask: int,
               dropped: Counter[str]) -> BatchMeta:
        lease = self._leases.open(partition, consumer, picked)
        self._table.lease(partition, picked, lease.batch_id)
        self._counts.consumer(consumer).in_flight += len(picked)
        return BatchMeta(batch_id=lease.batch_id, indices=[r.index for r in picked], fields_mask=mask,
                         dropped=dict(dropped))

    # ----------------------------------------------------------------- settling
    async def ack(self, batch_id: str) -> int:
        """The consumer is done with the batch: its samples are delivered and freed."""
        lease = self._leases.take(batch_id, "acked")
        self._table.settle(lease.records, "delivered")
        n = len(lease.records)
        self._counts.num_delivered += n
        stats = self._counts.consumer(lease.consumer)
        stats.in_flight -= n
        stats.delivered += n
        self._notify()
        await self._release([r.index for r in lease.records])
        return n

    async def nack(self, batch_id: str) -> int:
        """The consumer hands the batch back: its samples are ready again at once."""
        lease = self._leases.take(batch_id, "nacked")
        self._counts.consumer(lease.consumer).nacked += len(lease.records)
        n = self._return(lease)
        if self._leases.lost_returned:
            await self._drop_lost()
        return n

    async def extend_lease(self, batch_id: str) -> None:
        """Restart the lease clock of a batch its consumer is still working on."""
        self._leases.extend(batch_id)

    def expire_leases(self, force: bool = False) -> int:
        """Return every lease past its deadline (all leases with ``force``) to the ready set."""
        n = 0
        for lease in self._leases.due(force):
            self._leases.take(lease.batch_id, "expired")
            self._counts.consumer(lease.consumer).expired += len(lease.records)
            n += self._return(lease)
        return n

    def _return(self, lease: Lease) -> int:
        self._table.put_back(lease.partition, lease.records)  # in arrival order
        for rec in lease.records:
            if rec.mask & VERSIONS_BIT:
                self._stale.lower_floor(lease.partition, rec.min_version)
        n = len(lease.records)
        self._counts.num_redelivered += n
        self._counts.consumer(lease.consumer).in_flight -= n
        self._notify()
        return n

    # ------------------------------------------------------- lost storage units
    async def unit_lost(self, unit: int, generation: int | None = None) -> int:
        """Storage unit ``unit`` died (its actor of ``generation``; None: the current one),
        and the rows it held with it: new samples go to the other units until
        ``unit_replaced``, and every sample whose data it held is dropped, counted as
        ``"storage_lost"`` (a leased one when its lease comes back: nack or expiry).
        Returns how many it dropped now; 0 for a loss already known, or a report about
        an actor already replaced."""
        if not self._units.lose(unit, generation):
            return 0
        self._leases.mark_lost(self._units.on_lost)
        return await self._drop_lost()

    def unit_replaced(self, unit: int) -> int:
        """A new, empty actor serves storage unit ``unit`` (lost before): new samples are
        placed on it again, in slots from the lost ones' end on. Returns its generation."""
        return self._units.replaced(unit)

    def unit_state(self, unit: int) -> tuple[int, int, bool]:
        """Storage unit ``unit``'s generation (replacements so far), the first slot of it
        (the rows of slots below were lost), and whether an actor serves it now."""
        return self._units.state(unit)

    async def _drop_lost(self) -> int:
        self._leases.lost_returned = False
        lost = [r for part in self._table.pending.values() for r in part.values() if self._units.on_lost(r.index)]
        if lost:
            self._stale.note_lost(lost)
            await self._drop(lost, Counter(storage_lost=len(lost)))
        return len(lost)

    # --------------------------------------------------------------- lifecycle
    async def close(self) -> None:
        """No more puts; every waiter wakes (getters drain, then get EndOfStream)."""
        self._closed = True
        self._notify()

    def statistics(self) -> QueueStats:
        """The counters (``transfer_queue.counters``) and what each partition holds now."""
        partitions = {
            name: PartitionStats(pending=len(p), ready=sum(r.mask == FULL_MASK for r in p.values()))
            for name, p in self._table.pending.items()
        }
        for lease in self._leases.values():
            partitions.setdefault(lease.partition, PartitionStats()).in_flight += len(lease.records)
        return self._counts.statistics(partitions, capacity=self._cfg.capacity, closed=self._closed)

    def snapshot(self) -> tuple[Snapshot, dict[str, list[tuple[int, int]]]]:
        """Counters, and per partition the (index, mask) of every unsettled sample."""
        return self._counts.snapshot(self._stale.dead_groups()), self._table.unsettled()

    async def restore(self, snap: Snapshot) -> None:
        """Take the counters of a saved queue (after its samples were put back)."""
        self._counts.restore(snap)
        self._stale.restore(snap.dead_groups)

    # ----------------------------------------------------------------- helpers
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _release(self, indices: list[int]) -> None:
        if self._free is not None and indices:
            await self._free(indices)


async def _wait(event: asyncio.Event, deadline: float | None) -> bool:
    """Wait for ``event``; False when ``deadline`` (loop time) passes first."""
    if deadline is None:
        await event.wait()
        return True
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        return False
    try:
        await asyncio.wait_for(event.wait(), remaining)
    except TimeoutError:
        return False
    return True


def _checked_sampler(sampler: str, group_ids: list[str] | None, batch_size: int, group_size: int,
                     capacity: int) -> Sampler:
    """The sampler a get names (the groups it names, with ``group_ids``), its sizes checked."""
    pick = SAMPLERS.get(sampler)
    if pick is None:
        raise ValueError(f"unknown sampler {sampler!r}; samplers are {sorted(SAMPLERS)}")
    if group_ids is not None:
        if sampler != "grpo_group":
            raise ValueError(f"group_ids name whole groups: they need sampler='grpo_group', not {sampler!r}")
        if len(set(group_ids)) != len(group_ids) or batch_size != len(group_ids) * group_size:
            raise ValueError(f"group_ids must be {batch_size} // group_size={group_size} distinct groups, got "
                             f"{len(group_ids)} ({len(set(group_ids))} distinct)")
        pick = functools.partial(_named, group_ids)
    if not 1 <= batch_size <= capacity:
        raise ValueError(f"batch_size must be in [1, capacity={capacity}], got {batch_size}")
    if group_size < 1 or (sampler == "grpo_group" and batch_size % group_size):
        raise ValueError(f"batch_size={batch_size} must be a multiple of group_size={group_size} >= 1")
    return pick


def _named(group_ids: list[str], candidates: Iterable[Candidate], batch_size: int,
           group_size: int) -> list[Candidate] | None:
    """The sampler of a get that names its groups (``batch_size``: checked against them)."""
    return named_groups(candidates, group_ids, group_size)
