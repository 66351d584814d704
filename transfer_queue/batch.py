"""Batch: what ``get`` hands a consumer."""

from __future__ import annotations

from typing import Any

import numpy as np

from transfer_queue.codec import TOKEN_FIELDS, row_to_sample
from transfer_queue.sample import Sample

__all__ = ["Batch"]


class Batch:
    """A leased batch: ``batch_id`` to ack/nack, the samples, and what the get dropped.

    ``samples`` are built on first access from the storage rows (numpy -> lists),
    so a consumer that wants arrays can read ``column(name)`` and never pay for
    Python lists. ``dropped`` counts, per reason, the samples this get dropped
    (e.g. ``{"stale": 2}``); they are gone from the queue and in its statistics.
    """

    __slots__ = ("batch_id", "dropped", "_rows", "_samples")

    def __init__(self, batch_id: str, rows: list[dict[str, Any]], dropped: dict[str, int]) -> None:
        self.batch_id = batch_id
        self.dropped = dropped
        self._rows = rows
        self._samples: list[Sample] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"Batch(batch_id={self.batch_id!r}, num_samples={len(self)}, dropped={self.dropped})"

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            self._samples = [row_to_sample(r) for r in self._rows]
        return self._samples

    @property
    def uids(self) -> list[str]:
        return [r["uid"] for r in self._rows]

    @property
    def group_ids(self) -> list[str]:
        return [r["group_id"] for r in self._rows]

    def column(self, name: str) -> list[np.ndarray]:
        """One token field of every sample, as read-only-by-contract numpy arrays (no copy)."""
        if name not in TOKEN_FIELDS:
            raise ValueError(f"{name!r} is not a token field; token fields are {tuple(TOKEN_FIELDS)}")
        return [r[name] for r in self._rows]
