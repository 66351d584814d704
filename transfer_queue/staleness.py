"""Which pending samples a get must drop as too stale, and the groups that died.

A get with ``current_version`` and ``max_staleness`` first drops every pending
sample with ``current_version - min_version > max_staleness`` (reason
``"stale"``); with whole-group sampling the rest of each such group goes too
(``"stale_group"``: it can never be whole), and the group is *dead*: a sample
of it that arrives later is dropped on arrival. A per-partition floor of the
pending samples' oldest version lets a get skip the scan when nothing can be
stale. Groups with samples lost with a storage unit are remembered too: a
consumer that names one for a batch gets a clear error.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from transfer_queue.codec import fields_mask
from transfer_queue.records import Record, remember
from transfer_queue.samplers import is_stale

__all__ = ["VERSIONS_BIT", "Staleness"]

VERSIONS_BIT = fields_mask(["token_versions"])  # a sample's versions are known once this field is written


class Staleness:
    """The version floors, dead groups and lost groups of one controller."""

    def __init__(self) -> None:
        self._floor: dict[str, float] = {}  # partition -> lower bound of pending min_version
        self.dead: dict[str, dict[str, None]] = {}  # partition -> group ids dropped as stale
        self.lost: dict[str, None] = {}  # group ids with samples lost with a storage unit

    def lower_floor(self, partition: str, min_version: int) -> None:
        """A pending sample of ``partition`` (back, or newly versioned) has oldest version ``min_version``."""
        self._floor[partition] = min(self._floor.get(partition, math.inf), min_version)

    def stale(
        self, partition: str, pending: dict[int, Record], current_version: int, max_staleness: int,
        whole_groups: bool,
    ) -> tuple[list[Record], Counter[str]]:
        """The pending samples of ``partition`` a get at ``current_version`` drops, and why
        (by reason); with ``whole_groups`` their groups die and their siblings go too."""
        if current_version - self._floor.get(partition, math.inf) <= max_staleness:
            return [], Counter()  # nothing pending can be stale: skip the scan
        stale = [r for r in pending.values() if r.mask & VERSIONS_BIT and is_stale(r, current_version, max_staleness)]
        versioned = [r.min_version for r in pending.values() if r.mask & VERSIONS_BIT]
        self._floor[partition] = min(versioned, default=math.inf)
        if not stale:
            return [], Counter()
        reasons: Counter[str] = Counter(stale=len(stale))
        if whole_groups:
            dead = self.dead.setdefault(partition, {})
            for r in stale:
                remember(dead, r.group_id, None)
            stale_ids = {id(r) for r in stale}
            siblings = [r for r in pending.values() if r.group_id in dead and id(r) not in stale_ids]
            reasons["stale_group"] = len(siblings)
            stale += siblings
        return stale, +reasons

    def note_lost(self, records: Iterable[Record]) -> None:
        """These samples were lost with a storage unit: their groups can never be whole."""
        for r in records:
            remember(self.lost, r.group_id, None)

    def check_alive(self, partition: str, group_ids: Sequence[str]) -> None:
        """Raise for a named group whose samples were dropped: it can never be handed out whole."""
        dead = self.dead.get(partition, {})
        for gid in group_ids:
            if gid in dead:
                raise RuntimeError(f"group {gid!r} was named for a batch but the queue dropped it as stale; "
                                   "a consumer names only groups it knows are queued and fresh")
            if gid in self.lost:
                raise RuntimeError(f"group {gid!r} was named for a batch but its samples were lost with a "
                                   "storage unit")

    def dead_groups(self) -> dict[str, list[str]]:
        """The dead groups by partition, to be saved."""
        return {p: list(g) for p, g in self.dead.items()}

    def restore(self, dead_groups: dict[str, list[str]]) -> None:
        """Take the dead groups of a saved queue."""
        self.dead = {p: dict.fromkeys(g) for p, g in dead_groups.items()}
