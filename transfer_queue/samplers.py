"""Samplers: plain functions that pick a batch out of the ready samples.

A sampler sees the ready, unleased samples of one partition in arrival order
(lazily, so it can stop early) and returns the ones to hand out, in batch
order, or ``None`` when it cannot form a full batch yet. It never mutates
anything; the controller leases what it returns.

    sequential   the first ``batch_size`` ready samples (FIFO)
    grpo_group   whole GRPO groups only: a group is handed out once all its
                 ``group_size`` samples are ready; groups stay contiguous

The staleness filter runs before the sampler: ``is_stale`` says whether a
sample's version lag exceeds the consumer's bound; the controller drops such
samples with reason ``"stale"`` (and, for group sampling, the rest of their
group with reason ``"stale_group"``, since that group can never be whole).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

__all__ = ["SAMPLERS", "Candidate", "Sampler", "grpo_group", "is_stale", "sequential"]


class Candidate(Protocol):
    """What a sampler may look at: the controller's record of one ready sample."""

    index: int
    group_id: str
    min_version: int


Sampler = Callable[[Iterable[Candidate], int, int], "list[Candidate] | None"]


def sequential(candidates: Iterable[Candidate], batch_size: int, group_size: int = 1) -> list[Candidate] | None:
    """The first ``batch_size`` candidates in arrival order, or None if there are fewer."""
    picked: list[Candidate] = []
    for c in candidates:
        picked.append(c)
        if len(picked) == batch_size:
            return picked
    return None


def grpo_group(candidates: Iterable[Candidate], batch_size: int, group_size: int) -> list[Candidate] | None:
    """``batch_size // group_size`` whole groups, oldest first to complete, or None.

    A group counts once ``group_size`` of its samples are ready; groups with
    fewer wait (they are never split across batches). Members beyond
    ``group_size`` of a picked group wait for a later batch.
    """
    assert batch_size % group_size == 0, "checked by the caller"
    groups: dict[str, list[Candidate]] = {}  # group id -> members so far, or _TAKEN once picked
    picked: list[Candidate] = []
    for c in candidates:  # one dict lookup per candidate: this loop is most of an in-process get
        members = groups.get(c.group_id)
        if members is None:
            members = groups[c.group_id] = [c]
        elif members is _TAKEN:
            continue
        else:
            members.append(c)
        if len(members) == group_size:
            picked += members
            groups[c.group_id] = _TAKEN
            if len(picked) == batch_size:
                return picked
    return None


_TAKEN: list = []  # never appended to: a picked group's later members are skipped before that


def is_stale(candidate: Candidate, current_version: int, max_staleness: int) -> bool:
    """True when ``current_version - candidate.min_version > max_staleness``.

    A sample with no token versions (``min_version == -1``) lags by
    ``current_version + 1``: with no evidence of its version it is as old as can be.
    """
    return current_version - candidate.min_version > max_staleness


SAMPLERS: dict[str, Sampler] = {"sequential": sequential, "grpo_group": grpo_group}
