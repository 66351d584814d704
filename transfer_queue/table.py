"""The controller's table of resident samples: one record per sample put and not
yet settled (delivered or dropped), never its data.

    by_uid, by_index     every resident sample
    pending[partition]   the unleased ones, in arrival order (``seq``): what samplers see

A settled uid is remembered (the newest ``records.MAX_REMEMBERED``), so writing
it again is a clear error rather than a second sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from transfer_queue.records import Record, remember
from transfer_queue.staleness import VERSIONS_BIT
from transfer_queue.wire import SampleTags

__all__ = ["SampleTable"]


class SampleTable:
    """Records by uid, by global index, and unleased per partition in arrival order."""

    def __init__(self) -> None:
        self.by_uid: dict[str, Record] = {}
        self.by_index: dict[int, Record] = {}
        self.pending: dict[str, dict[int, Record]] = {}  # partition -> seq -> unleased record
        self._settled: dict[str, str] = {}  # uid -> "delivered" | "dropped"
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self.by_uid)

    def check_write(self, partition: str, tags: Iterable[SampleTags], new_only: bool) -> int:
        """How many of ``tags`` are new samples; a ValueError (RuntimeError: leased) for one that
        cannot be written: twice in the write, settled, known (``new_only``), or elsewhere."""
        seen: set[str] = set()
        num_new = 0
        for t in tags:
            if t.uid in seen:
                raise ValueError(f"uid {t.uid!r} appears twice in one put")
            seen.add(t.uid)
            rec = self.by_uid.get(t.uid)
            if rec is None and t.uid in self._settled:
                raise ValueError(f"uid {t.uid!r} was already {self._settled[t.uid]}; it cannot be written again")
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

    def add(self, partition: str, tag: SampleTags, index: int) -> Record:
        """Register a new sample at global ``index``, pending (no field ready yet)."""
        assert index not in self.by_index, f"index {index} is taken: blocks from allocate are disjoint"
        rec = Record(index, self._next_seq, tag.uid, tag.group_id, partition)
        self._next_seq += 1
        self.by_uid[tag.uid] = self.by_index[index] = self.pending.setdefault(partition, {})[rec.seq] = rec
        return rec

    def mark_written(self, indices: Iterable[int], tags: Iterable[SampleTags],
                     versioned: Callable[[str, int], None]) -> list[int]:
        """Record the written fields (``versioned(partition, min_version)`` for a pending sample
        whose versions came); returns the indices whose sample was dropped meanwhile."""
        orphans = []
        for index, t in zip(indices, tags):
            if index < 0:
                continue
            rec = self.by_index.get(index)
            if rec is None or rec.uid != t.uid:  # dropped while its data was being written
                orphans.append(index)
                continue
            rec.mask |= t.mask
            if t.mask & VERSIONS_BIT:
                rec.min_version, rec.max_version = t.min_version, t.max_version
                if rec.lease is None:
                    versioned(rec.partition, t.min_version)
            if t.num_prompt_tokens >= 0:
                rec.num_prompt_tokens = t.num_prompt_tokens
            if t.num_response_tokens >= 0:
                rec.num_response_tokens = t.num_response_tokens
        return orphans

    def settle(self, recs: Iterable[Record], why: str) -> None:
        """These samples leave the queue (``why``: delivered or dropped)."""
        for rec in recs:
            del self.by_uid[rec.uid], self.by_index[rec.index]
            remember(self._settled, rec.uid, why)
            self.pending[rec.partition].pop(rec.seq, None)

    def lease(self, partition: str, recs: Iterable[Record], batch_id: str) -> None:
        """These pending samples of ``partition`` are leased in ``batch_id``."""
        pending = self.pending[partition]
        for rec in recs:
            del pending[rec.seq]
            rec.lease = batch_id

    def put_back(self, partition: str, recs: Iterable[Record]) -> None:
        """Leased samples of ``partition`` are pending again, in arrival order."""
        pending = self.pending[partition]
        for rec in recs:
            rec.lease = None
            pending[rec.seq] = rec
        self.pending[partition] = dict(sorted(pending.items()))

    def groups(self, partition: str) -> list[tuple[str, int, int]]:
        """(group id, samples, oldest token version) of every group with unleased samples,
        in the arrival order of each group's first sample."""
        groups: dict[str, list[int]] = {}
        for rec in self.pending.get(partition, {}).values():
            got = groups.setdefault(rec.group_id, [0, rec.min_version])
            got[0] += 1
            got[1] = min(got[1], rec.min_version)
        return [(gid, n, v) for gid, (n, v) in groups.items()]

    def unsettled(self) -> dict[str, list[tuple[int, int]]]:
        """Per partition the (index, mask) of every sample with a field written, in arrival order."""
        samples: dict[str, list[tuple[int, int]]] = {}
        for rec in sorted(self.by_uid.values(), key=lambda r: r.seq):
            if rec.mask:
                samples.setdefault(rec.partition, []).append((rec.index, rec.mask))
        return samples
