"""Samplers: plain functions that pick a batch out of the ready samples.

A sampler sees the ready, unleased samples of one partition in arrival order
(lazily, so it can stop early) and returns the ones to hand out, in batch
order, or ``None`` when it cannot form a full batch yet. It never mutates
anything; the controller leases what it returns.

    sequential   the first ``batch_size`` ready samples (FIFO)
    grpo_group   whole GRPO groups only: a group is handed out once all its
                 ``group_size`` samples are ready; groups stay contiguous
    named_groups the whole groups a consumer names, in its order (the policy
                 decides which groups a step trains; ``get(group_ids=...)``)

The staleness filter runs before the sampler: ``is_stale`` says whether a
sample's version lag exceeds the consumer's bound; the controller drops such
samples with reason ``"stale"`` (and, for group sampling, the rest of their
group with reason ``"stale_group"``, since that group can never be whole).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

__all__ = ["SAMPLERS", "Candidate", "Sampler", "grpo_group", "is_stale", "named_groups", "sequential"]


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


def named_groups(candidates: Iterable[Candidate], group_ids: Sequence[str], group_size: int) -> list[Candidate] | None:
    """The groups ``group_ids``, whole (``group_size`` samples each) and in that order, or
    None until every one of them is. Members beyond ``group_size`` wait for a later batch;
    candidates of other groups are not looked at."""
    members: dict[str, list[Candidate]] = {gid: [] for gid in group_ids}
    missing = len(members)
    for c in candidates:
        got = members.get(c.group_id)
        if got is None or len(got) == group_size:
            continue
        got.append(c)
        if len(got) == group_size:
            missing -= 1
            if not missing:
                return [c for gid in group_ids for c in members[gid]]
    return None


def is_stale(candidate: Candidate, current_version: int, max_staleness: int) -> bool:
    """True when ``current_version - candidate.min_version > max_staleness``.

    A sample with no token versions (``min_version == -1``) lags by
    ``current_version + 1``: with no evidence of its version it is as old as can be.
    """
    return current_version - candidate.min_version > max_staleness


SAMPLERS: dict[str, Sampler] = {"sequential": sequential, "grpo_group": grpo_group}
