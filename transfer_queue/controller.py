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

A storage unit whose actor died (Ray: its node was lost) is reported with
``unit_lost``: the samples it held are dropped, counted (``"storage_lost"``),
and new samples go to the other units until ``unit_replaced`` says a new actor
serves it; it then takes new samples again, in slots above the lost ones.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from transfer_queue.codec import FULL_MASK, fields_mask
from transfer_queue.config import TransferQueueConfig
from transfer_queue.counters import QueueCounters
from transfer_queue.errors import EndOfStream, LeaseLost, QueueClosed, QueueEmpty, QueueFull, StorageUnitLost
from transfer_queue.records import Lease, Record, remember
from transfer_queue.samplers import SAMPLERS, is_stale, named_groups
from transfer_queue.wire import BatchMeta, PartitionStats, QueueStats, SampleTags, Snapshot

__all__ = ["Controller"]

_VERSIONS_BIT = fields_mask(["token_versions"])


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
        self._cfg, self._free, self._clock = cfg, free, clock
        self._by_uid: dict[str, Record] = {}
        self._by_index: dict[int, Record] = {}
        self._pending: dict[str, dict[int, Record]] = {}  # partition -> seq -> unleased record, arrival order
        self._version_floor: dict[str, float] = {}  # partition -> lower bound of pending min_version
        self._leases: dict[str, Lease] = {}
        self._settled: dict[str, str] = {}  # batch id -> why it is no longer leased
        self._settled_uids: dict[str, str] = {}  # uid -> "delivered" | "dropped (reason)"
        self._dead_groups: dict[str, dict[str, None]] = {}  # partition -> group ids
        self._lost_groups: dict[str, None] = {}  # group ids with samples lost with a storage unit
        self._counts = QueueCounters()  # put, delivered, redelivered, dropped; per consumer
        # A put's new samples all go to one storage unit (round robin over puts), so a
        # write is one message: global index = slot * num_storage_units + unit.
        # ``allocate`` hands whole blocks of slots to Ray clients.
        self._next_slot = [0] * cfg.num_storage_units
        self._next_unit = self._next_seq = self._next_batch = 0
        # Storage units lost (their actor died, and the rows it held): ``_down`` have no actor
        # now (new samples go to the others); slots of unit u below ``_lost_below[u]`` were on
        # an actor that died, slots from it on are its replacement's (``unit_replaced``).
        self._down: set[int] = set()
        self._lost_below: dict[int, int] = {}
        self._generation = [0] * cfg.num_storage_units  # per unit: replacements so far
        self._lost_leases: set[str] = set()  # leases holding samples of a lost unit: dropped when they come back
        self._lost_returned = False  # such a lease came back (nack, expiry): drop its lost samples
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
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        while True:
            num_new = self._validate_write(partition, tags, new_only)
            if num_new > self._cfg.capacity:
                raise ValueError(f"put of {num_new} new samples exceeds capacity={self._cfg.capacity}")
            if len(self._by_uid) + num_new <= self._cfg.capacity:
                break
            if not wait:
                raise QueueFull(f"{len(self._by_uid)} of {self._cfg.capacity} samples resident; {num_new} more do not fit")
            if not await self._wait(self._changed, deadline):
                raise TimeoutError(f"put waited {timeout_s}s for capacity")
        dead = self._dead_groups.get(partition, {})
        pending = self._pending.setdefault(partition, {})
        num_units = len(self._next_slot)
        unit = self._next_unit
        if indices is None:
            live = [u for u in range(num_units) if u not in self._down]
            if not live:
                raise StorageUnitLost(-1, "every storage unit of this TransferQueue is gone")
            if unit in self._down:
                unit = min(live, key=lambda u: (u - unit) % num_units)  # the next live one
            self._next_unit = (unit + 1) % num_units
        else:
            assert new_only and len(indices) == len(tags), "placed indices are for whole new samples"
            if indices and self._lost_below and self._on_lost_unit(indices[0]):  # a block's indices share a unit
                raise StorageUnitLost(indices[0] % num_units, f"index {indices[0]} is of a block allocated before "
                                      "its storage unit was lost; take a new block (its replacement's)")
        placed = []
        for i, t in enumerate(tags):
            rec = self._by_uid.get(t.uid)
            if rec is None:
                self._counts.num_put += 1
                if t.group_id in dead:
                    self._counts.dropped["stale_group"] += 1
                    placed.append(-1)
                    continue
                if indices is None:
                    index = self._next_slot[unit] * num_units + unit
                    self._next_slot[unit] += 1
                else:
                    index = indices[i]
                    assert index not in self._by_index, f"index {index} is taken: blocks from allocate are disjoint"
                rec = Record(index, self._next_seq, t.uid, t.group_id, partition)
                self._next_seq += 1
                self._by_uid[t.uid] = self._by_index[rec.index] = pending[rec.seq] = rec
            placed.append(rec.index)
        if commit:
            orphans = self._mark_written(placed, tags)
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
        if not 0 <= unit < len(self._next_slot) or num_slots < 1:
            raise ValueError(f"allocate needs a unit in [0, {len(self._next_slot)}) and num_slots >= 1")
        start = self._next_slot[unit]
        self._next_slot[unit] += num_slots
        return start

    def _validate_write(self, partition: str, tags: list[SampleTags], new_only: bool) -> int:
        if self._closed:
            raise QueueClosed("put on a closed TransferQueue")
        seen: set[str] = set()
        num_new = 0
        for t in tags:
            if t.uid in seen:
                raise ValueError(f"uid {t.uid!r} appears twice in one put")
            seen.add(t.uid)
            rec = self._by_uid.get(t.uid)
            if rec is None and t.uid in self._settled_uids:
                raise ValueError(f"uid {t.uid!r} was already {self._settled_uids[t.uid]}; it cannot be written again")
            if rec is None:
                num_new += 1
            elif new_only:
                raise ValueError(f"uid {t.uid!r} is already in the queue (use put_fields to add fields)")
            elif rec.partition != partition:
                raise ValueError(f"uid {t.uid!r} is in partition {rec.partition!r}, not {partition!r}")
            elif rec.lease is not None:
                raise RuntimeError(f"uid {t.uid!r} is leased in batch {rec.lease!r}; its fields cannot change")
            elif rec.group_id != t.group_id:
                raise ValueError(f"uid {t.uid!r} has group_id {rec.group_id!r}, not {t.group_id!r}")
        return num_new

    async def commit(self, indices: list[int], tags: list[SampleTags]) -> None:
        """Mark the fields in ``tags`` ready for the written ``indices``; wake getters."""
        orphans = self._mark_written(indices, tags)
        self._notify()
        if orphans:
            await self._release(orphans)

    def _mark_written(self, indices: list[int], tags: list[SampleTags]) -> list[int]:
        """Record the written fields; returns the indices whose sample was dropped meanwhile."""
        orphans = []
        for index, t in zip(indices, tags):
            if index < 0:
                continue
            rec = self._by_index.get(index)
            if rec is None or rec.uid != t.uid:  # dropped while its data was being written
                orphans.append(index)
                continue
            rec.mask |= t.mask
            if t.mask & _VERSIONS_BIT:
                rec.min_version, rec.max_version = t.min_version, t.max_version
                if rec.lease is None:
                    floor = self._version_floor.get(rec.partition, math.inf)
                    self._version_floor[rec.partition] = min(floor, t.min_version)
            if t.num_prompt_tokens >= 0:
                rec.num_prompt_tokens = t.num_prompt_tokens
            if t.num_response_tokens >= 0:
                rec.num_response_tokens = t.num_response_tokens
        return orphans

    async def drop(self, uids: list[str], reason: str) -> int:
        """Drop pending samples by uid, counted under ``reason``; all or nothing."""
        if not reason or not isinstance(reason, str):
            raise ValueError(f"drop reason must be a non-empty string, got {reason!r}")
        recs = []
        for uid in uids:
            rec = self._by_uid.get(uid)
            if rec is None:
                raise LookupError(f"uid {uid!r} is not in the queue (delivered, dropped or never put)")
            if rec.lease is not None:
                raise RuntimeError(f"uid {uid!r} is leased in batch {rec.lease!r}; nack it before dropping")
            recs.append(rec)
        if recs:
            await self._drop(recs, Counter({reason: len(recs)}))
        return len(recs)

    async def _drop(self, recs: list[Record], reasons: Counter[str]) -> None:
        for rec in recs:
            del self._by_uid[rec.uid], self._by_index[rec.index]
            remember(self._settled_uids, rec.uid, "dropped")
            self._pending[rec.partition].pop(rec.seq, None)
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
        pick = SAMPLERS.get(sampler)
        if pick is None:
            raise ValueError(f"unknown sampler {sampler!r}; samplers are {sorted(SAMPLERS)}")
        if group_ids is not None:
            group_ids = list(group_ids)
            if sampler != "grpo_group":
                raise ValueError(f"group_ids name whole groups: they need sampler='grpo_group', not {sampler!r}")
            if len(set(group_ids)) != len(group_ids) or batch_size != len(group_ids) * group_size:
                raise ValueError(f"group_ids must be {batch_size} // group_size={group_size} distinct groups, got "
                                 f"{len(group_ids)} ({len(set(group_ids))} distinct)")
            named = group_ids

            def pick(candidates, batch_size, group_size):  # noqa: ARG001 -- batch_size checked above
                return named_groups(candidates, named, group_size)
        if not 1 <= batch_size <= self._cfg.capacity:
            raise ValueError(f"batch_size must be in [1, capacity={self._cfg.capacity}], got {batch_size}")
        if group_size < 1 or (sampler == "grpo_group" and batch_size % group_size):
            raise ValueError(f"batch_size={batch_size} must be a multiple of group_size={group_size} >= 1")
        if (current_version is None) != (max_staleness is None) or (max_staleness or 0) < 0:
            raise ValueError("pass current_version and max_staleness >= 0 together (or neither)")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        dropped: Counter[str] = Counter()
        while True:
            changed = self._changed
            self.expire_leases()
            if self._lost_returned:  # a lease that came back held samples of a lost unit
                await self._drop_lost()
            if current_version is not None and max_staleness is not None:  # given together (checked above)
                await self._drop_stale(partition, current_version, max_staleness, sampler == "grpo_group", dropped)
            if group_ids is not None:
                self._check_alive(partition, group_ids)
            pending = self._pending.get(partition, {})
            picked = None
            if len(pending) >= batch_size:  # every sampler needs that many: skip the scan each write wakes
                picked = pick((r for r in pending.values() if r.mask & mask == mask), batch_size, group_size)
            if picked is not None:
                return self._lease(partition, consumer, picked, mask, dropped)
            if self._closed:
                raise EndOfStream(f"partition {partition!r} is closed and cannot form a batch of {batch_size}")
            if timeout_s == 0:
                raise QueueEmpty(f"no batch of {batch_size} ready in partition {partition!r}")
            if not await self._wait(changed, deadline):
                raise TimeoutError(f"no batch of {batch_size} ready in partition {partition!r} after {timeout_s}s")

    def _check_alive(self, partition: str, group_ids: list[str]) -> None:
        """Raise for a named group whose samples were dropped: it can never be handed out whole."""
        dead = self._dead_groups.get(partition, {})
        for gid in group_ids:
            if gid in dead:
                raise RuntimeError(f"group {gid!r} was named for a batch but the queue dropped it as stale; "
                                   "a consumer names only groups it knows are queued and fresh")
            if gid in self._lost_groups:
                raise RuntimeError(f"group {gid!r} was named for a batch but its samples were lost with a "
                                   "storage unit")

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
        groups: dict[str, list[int]] = {}
        for rec in self._pending.get(partition, {}).values():
            got = groups.setdefault(rec.group_id, [0, rec.min_version])
            got[0] += 1
            got[1] = min(got[1], rec.min_version)
        return [(gid, n, v) for gid, (n, v) in groups.items()]

    async def _drop_stale(
        self, partition: str, current_version: int, max_staleness: int, whole_groups: bool, dropped: Counter[str]
    ) -> None:
        floor = self._version_floor.get(partition, math.inf)
        if current_version - floor <= max_staleness:  # nothing pending can be stale: skip the scan
            return
        pending = self._pending.get(partition, {})
        stale = [r for r in pending.values() if r.mask & _VERSIONS_BIT and is_stale(r, current_version, max_staleness)]
        versioned = [r.min_version for r in pending.values() if r.mask & _VERSIONS_BIT]
        self._version_floor[partition] = min(versioned, default=math.inf)
        if not stale:
            return
        reasons: Counter[str] = Counter(stale=len(stale))
        if whole_groups:
            dead = self._dead_groups.setdefault(partition, {})
            for r in stale:
                remember(dead, r.group_id, None)
            stale_ids = {id(r) for r in stale}
            siblings = [r for r in pending.values() if r.group_id in dead and id(r) not in stale_ids]
            reasons["stale_group"] = len(siblings)
            stale += siblings
        dropped.update(+reasons)
        await self._drop(stale, +reasons)

    def _lease(self, partition: str, consumer: str, picked: list, mask: int, dropped: Counter[str]) -> BatchMeta:
        batch_id = f"{consumer}#{self._next_batch}"
        self._next_batch += 1
        pending = self._pending[partition]
        for rec in picked:
            del pending[rec.seq]
            rec.lease = batch_id
        lease = Lease(batch_id, consumer, partition, picked, self._clock() + self._cfg.lease_s)
        self._leases[batch_id] = lease
        self._arm(lease)
        self._counts.consumer(consumer).in_flight += len(picked)
        return BatchMeta(batch_id=batch_id, indices=[r.index for r in picked], fields_mask=mask, dropped=dict(dropped))

    # ----------------------------------------------------------------- settling
    async def ack(self, batch_id: str) -> int:
        """The consumer is done with the batch: its samples are delivered and freed."""
        lease = self._take_lease(batch_id, "acked")
        for rec in lease.records:
            del self._by_uid[rec.uid], self._by_index[rec.index]
            remember(self._settled_uids, rec.uid, "delivered")
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
        lease = self._take_lease(batch_id, "nacked")
        self._counts.consumer(lease.consumer).nacked += len(lease.records)
        n = self._return(lease)
        if self._lost_returned:
            await self._drop_lost()
        return n

    async def extend_lease(self, batch_id: str) -> None:
        """Restart the lease clock of a batch its consumer is still working on."""
        lease = self._leases.get(batch_id)
        if lease is None:
            raise LeaseLost(f"batch {batch_id!r} is not leased ({self._settled.get(batch_id, 'unknown')})")
        lease.deadline_s = self._clock() + self._cfg.lease_s
        if lease.timer is not None:
            lease.timer.cancel()
        self._arm(lease)

    def expire_leases(self, force: bool = False) -> int:
        """Return every lease past its deadline (all leases with ``force``) to the ready set."""
        now = self._clock()
        due = [lease for lease in self._leases.values() if force or lease.deadline_s <= now]
        n = 0
        for lease in due:
            self._take_lease(lease.batch_id, "expired")
            self._counts.consumer(lease.consumer).expired += len(lease.records)
            n += self._return(lease)
        return n

    def _take_lease(self, batch_id: str, why: str) -> Lease:
        lease = self._leases.pop(batch_id, None)
        if lease is None:
            raise LeaseLost(f"batch {batch_id!r} is not leased ({self._settled.get(batch_id, 'unknown batch id')})")
        if lease.timer is not None:
            lease.timer.cancel()
        remember(self._settled, batch_id, why)
        if batch_id in self._lost_leases:
            self._lost_leases.discard(batch_id)
            self._lost_returned |= why != "acked"  # back in the ready set: its lost samples go
        return lease

    def _return(self, lease: Lease) -> int:
        pending = self._pending[lease.partition]
        floor = self._version_floor.get(lease.partition, math.inf)
        for rec in lease.records:
            rec.lease = None
            pending[rec.seq] = rec
            if rec.mask & _VERSIONS_BIT:
                floor = min(floor, rec.min_version)
        self._version_floor[lease.partition] = floor
        self._pending[lease.partition] = dict(sorted(pending.items()))  # back in arrival order
        n = len(lease.records)
        self._counts.num_redelivered += n
        self._counts.consumer(lease.consumer).in_flight -= n
        self._notify()
        return n

    def _arm(self, lease: Lease) -> None:
        if math.isfinite(self._cfg.lease_s):
            loop = asyncio.get_running_loop()
            lease.timer = loop.call_later(self._cfg.lease_s, self._on_timer, lease.batch_id)

    def _on_timer(self, batch_id: str) -> None:
        lease = self._leases.get(batch_id)
        if lease is None:
            return
        if self._clock() >= lease.deadline_s:
            self.expire_leases()
        else:  # the clock says not yet (lease extended, or a test clock): look again later
            self._arm(lease)

    # ------------------------------------------------------- lost storage units
    async def unit_lost(self, unit: int, generation: int | None = None) -> int:
        """Storage unit ``unit`` died (its actor of ``generation``; None: the current one),
        and the rows it held with it: new samples go to the other units until
        ``unit_replaced``, and every sample whose data it held is dropped, counted as
        ``"storage_lost"`` (a leased one when its lease comes back: nack or expiry).
        Returns how many it dropped now; 0 for a loss already known, or a report about
        an actor already replaced."""
        if not 0 <= unit < len(self._next_slot):
            raise ValueError(f"unit_lost needs a unit in [0, {len(self._next_slot)}), got {unit}")
        if unit in self._down or generation not in (None, self._generation[unit]):
            return 0
        self._down.add(unit)
        self._lost_below[unit] = self._next_slot[unit]  # every slot handed out so far, clients' blocks too
        self._lost_leases.update(lease.batch_id for lease in self._leases.values()
                                 if any(self._on_lost_unit(r.index) for r in lease.records))
        return await self._drop_lost()

    def unit_replaced(self, unit: int) -> int:
        """A new, empty actor serves storage unit ``unit`` (lost before): new samples are
        placed on it again, in slots from the lost ones' end on. Returns its generation."""
        assert unit in self._down, f"storage unit {unit} is not lost: nothing to replace"
        self._down.discard(unit)
        self._generation[unit] += 1
        return self._generation[unit]

    def unit_state(self, unit: int) -> tuple[int, int, bool]:
        """Storage unit ``unit``'s generation (replacements so far), the first slot of it
        (the rows of slots below were lost), and whether an actor serves it now."""
        return self._generation[unit], self._lost_below.get(unit, 0), unit not in self._down

    def _on_lost_unit(self, index: int) -> bool:
        """Whether the row of global ``index`` was on a storage unit's actor that died."""
        n = len(self._next_slot)
        below = self._lost_below.get(index % n)
        return below is not None and index // n < below

    async def _drop_lost(self) -> int:
        self._lost_returned = False
        lost = [r for part in self._pending.values() for r in part.values() if self._on_lost_unit(r.index)]
        if lost:
            for r in lost:
                remember(self._lost_groups, r.group_id, None)
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
            for name, p in self._pending.items()
        }
        for lease in self._leases.values():
            partitions.setdefault(lease.partition, PartitionStats()).in_flight += len(lease.records)
        return self._counts.statistics(partitions, capacity=self._cfg.capacity, closed=self._closed)

    def snapshot(self) -> tuple[Snapshot, dict[str, list[tuple[int, int]]]]:
        """Counters, and per partition the (index, mask) of every unsettled sample."""
        samples: dict[str, list[tuple[int, int]]] = {}
        for rec in sorted(self._by_uid.values(), key=lambda r: r.seq):
            if rec.mask:
                samples.setdefault(rec.partition, []).append((rec.index, rec.mask))
        return self._counts.snapshot({p: list(g) for p, g in self._dead_groups.items()}), samples

    async def restore(self, snap: Snapshot) -> None:
        """Take the counters of a saved queue (after its samples were put back)."""
        self._counts.restore(snap)
        self._dead_groups = {p: dict.fromkeys(g) for p, g in snap.dead_groups.items()}

    # ----------------------------------------------------------------- helpers
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _release(self, indices: list[int]) -> None:
        if self._free is not None and indices:
            await self._free(indices)

    @staticmethod
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
