"""The batches a controller has leased to consumers.

    open(records) ─► Lease (batch id, deadline, timer) ─► take(batch id, why): acked | nacked | expired
                                         └─ extend(batch id): the deadline starts again

A lease's timer fires at its deadline and has the controller return every
lease that is due (``on_due``); the clock decides, so a lease extended meanwhile
(or a test's fake clock) only re-arms it. A batch no longer leased is
remembered with why, for a clear ``LeaseLost``. A lease holding samples of a
storage unit that was lost is marked: when it comes back unacked, the
controller drops those samples (``lost_returned``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator

from transfer_queue.errors import LeaseLost
from transfer_queue.records import Lease, Record, remember

__all__ = ["LeaseBook"]


class LeaseBook:
    """Every open lease by batch id (iterating it gives the batch ids, as a dict's keys).

    ``lease_s``: how long a lease lasts; ``clock``: monotonic seconds;
    ``on_due``: called when a timer finds its lease due.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float], on_due: Callable[[], object]) -> None:
        self._lease_s, self._clock, self._on_due = lease_s, clock, on_due
        self._open: dict[str, Lease] = {}
        self._settled: dict[str, str] = {}  # batch id -> why it is no longer leased
        self._next_batch = 0
        self._lost: set[str] = set()  # leases holding samples of a lost unit: dropped when they come back
        self.lost_returned = False  # such a lease came back (nack, expiry): drop its lost samples

    def __iter__(self) -> Iterator[str]:
        return iter(self._open)

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._open

    def values(self) -> Iterator[Lease]:
        """The open leases."""
        return iter(list(self._open.values()))

    def open(self, partition: str, consumer: str, records: list[Record]) -> Lease:
        """A new lease of ``records`` for ``consumer``, its timer armed."""
        batch_id = f"{consumer}#{self._next_batch}"
        self._next_batch += 1
        lease = Lease(batch_id, consumer, partition, records, self._clock() + self._lease_s)
        self._open[batch_id] = lease
        self._arm(lease)
        return lease

    def take(self, batch_id: str, why: str) -> Lease:
        """Close the lease of ``batch_id`` (``why``: acked, nacked or expired); LeaseLost if none."""
        lease = self._open.pop(batch_id, None)
        if lease is None:
            raise LeaseLost(f"batch {batch_id!r} is not leased ({self._settled.get(batch_id, 'unknown batch id')})")
        if lease.timer is not None:
            lease.timer.cancel()
        remember(self._settled, batch_id, why)
        if batch_id in self._lost:
            self._lost.discard(batch_id)
            self.lost_returned |= why != "acked"  # back in the ready set: its lost samples go
        return lease

    def extend(self, batch_id: str) -> None:
        """Restart the lease clock of ``batch_id``; LeaseLost if it is not leased."""
        lease = self._open.get(batch_id)
        if lease is None:
            raise LeaseLost(f"batch {batch_id!r} is not leased ({self._settled.get(batch_id, 'unknown')})")
        lease.deadline_s = self._clock() + self._lease_s
        if lease.timer is not None:
            lease.timer.cancel()
        self._arm(lease)

    def due(self, force: bool = False) -> list[Lease]:
        """The leases past their deadline (every one with ``force``), still open."""
        now = self._clock()
        return [lease for lease in self._open.values() if force or lease.deadline_s <= now]

    def mark_lost(self, on_lost: Callable[[int], bool]) -> None:
        """Mark every open lease holding a sample whose index ``on_lost`` says was lost."""
        self._lost.update(lease.batch_id for lease in self._open.values()
                          if any(on_lost(r.index) for r in lease.records))

    def _arm(self, lease: Lease) -> None:
        if math.isfinite(self._lease_s):
            loop = asyncio.get_running_loop()
            lease.timer = loop.call_later(self._lease_s, self._on_timer, lease.batch_id)

    def _on_timer(self, batch_id: str) -> None:
        lease = self._open.get(batch_id)
        if lease is None:
            return
        if self._clock() >= lease.deadline_s:
            self._on_due()
        else:  # the clock says not yet (lease extended, or a test clock): look again later
            self._arm(lease)
