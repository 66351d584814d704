"""The controller's bookkeeping records: one per sample, one per leased batch."""

from __future__ import annotations

import asyncio

__all__ = ["Lease", "Record", "remember"]

MAX_REMEMBERED = 65536  # settled batch ids / uids / dead groups kept for clear errors


class Record:
    """What the controller knows about one sample (never its data)."""

    __slots__ = ("index", "seq", "uid", "group_id", "partition", "mask", "min_version", "max_version",
                 "num_prompt_tokens", "num_response_tokens", "lease")  # fmt: skip

    def __init__(self, index: int, seq: int, uid: str, group_id: str, partition: str) -> None:
        self.index, self.seq, self.uid, self.group_id, self.partition = index, seq, uid, group_id, partition
        self.mask = 0
        self.min_version = self.max_version = -1
        self.num_prompt_tokens = self.num_response_tokens = -1
        self.lease: str | None = None  # batch id while leased


class Lease:
    """A batch handed to a consumer: its samples, and when the lease runs out."""

    __slots__ = ("batch_id", "consumer", "partition", "records", "deadline_s", "timer")

    def __init__(self, batch_id: str, consumer: str, partition: str, records: list[Record], deadline_s: float):
        self.batch_id, self.consumer, self.partition = batch_id, consumer, partition
        self.records, self.deadline_s = records, deadline_s
        self.timer: asyncio.TimerHandle | None = None


def remember(store: dict, key: str, value: object) -> None:
    """``store[key] = value``, forgetting the oldest entry past MAX_REMEMBERED."""
    store[key] = value
    if len(store) > MAX_REMEMBERED:
        del store[next(iter(store))]
