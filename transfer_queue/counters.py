"""The counters of a TransferQueue: samples put, delivered, redelivered and
dropped (by reason), and what each named consumer holds and has settled.

They are the part of the controller's state that outlives its samples: what
``statistics`` reports beside the live counts (pending, leased), and what a
``snapshot`` saves and a ``restore`` takes back. The controller moves them;
this module only keeps and reports them.
"""

from __future__ import annotations

from collections import Counter

from transfer_queue.wire import ConsumerStats, PartitionStats, QueueStats, Snapshot

__all__ = ["QueueCounters"]


class QueueCounters:
    """Running totals of one TransferQueue (see :class:`transfer_queue.wire.QueueStats`)."""

    def __init__(self) -> None:
        self.num_put = 0  # distinct samples ever registered
        self.num_delivered = 0  # samples acknowledged by a consumer
        self.num_redelivered = 0  # samples returned to the ready set by nack or lease expiry
        self.dropped: Counter[str] = Counter()  # samples removed without delivery, by reason
        self.consumers: dict[str, ConsumerStats] = {}

    def consumer(self, name: str) -> ConsumerStats:
        """The counters of consumer ``name`` (new ones start at zero)."""
        stats = self.consumers.get(name)
        if stats is None:
            stats = self.consumers[name] = ConsumerStats()
        return stats

    def consumers_copy(self) -> dict[str, ConsumerStats]:
        """Each consumer's counters, copied: the caller may keep or send them."""
        return {k: ConsumerStats(**{f: getattr(v, f) for f in v.__struct_fields__}) for k, v in self.consumers.items()}

    def statistics(self, partitions: dict[str, PartitionStats], *, capacity: int, closed: bool) -> QueueStats:
        """The queue's statistics: these totals and the live ``partitions``."""
        return QueueStats(
            put=self.num_put,
            delivered=self.num_delivered,
            dropped=sum(self.dropped.values()),
            pending=sum(p.pending for p in partitions.values()),
            in_flight=sum(p.in_flight for p in partitions.values()),
            redelivered=self.num_redelivered,
            capacity=capacity,
            closed=closed,
            dropped_by_reason=dict(self.dropped),
            partitions=partitions,
            consumers=self.consumers_copy(),
        )

    def snapshot(self, dead_groups: dict[str, list[str]]) -> Snapshot:
        """These totals and the controller's ``dead_groups``, to be saved."""
        return Snapshot(
            put=self.num_put,
            delivered=self.num_delivered,
            redelivered=self.num_redelivered,
            dropped_by_reason=dict(self.dropped),
            dead_groups=dead_groups,
            consumers=self.consumers_copy(),
        )

    def restore(self, snap: Snapshot) -> None:
        """Take the totals of a saved queue; no consumer holds a lease after a restore."""
        self.num_put, self.num_delivered, self.num_redelivered = snap.put, snap.delivered, snap.redelivered
        self.dropped = Counter(snap.dropped_by_reason)
        for name, stats in snap.consumers.items():
            stats.in_flight = 0
            self.consumers[name] = stats
