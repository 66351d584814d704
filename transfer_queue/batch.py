"""Batch: what ``get`` hands a consumer."""

from __future__ import annotations

import numpy as np

from transfer_queue.codec import TOKEN_FIELDS
from transfer_queue.rows import Rows
from contracts.sample import Sample

__all__ = ["Batch"]


class Batch:
    """A leased batch: ``batch_id`` to ack/nack, the samples, and what the get dropped.

    ``samples`` (token fields as they were put: lists, or read-only arrays) are built
    on first access (``get`` itself only leases and fetches the data), then cached.
    ``dropped`` counts, per reason, the samples this get dropped (e.g. ``{"stale": 2}``);
    they are gone from the queue and in its statistics.
    """

    __slots__ = ("batch_id", "dropped", "_rows", "_samples")

    def __init__(self, batch_id: str, rows: Rows, dropped: dict[str, int]) -> None:
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
            self._samples = self._rows.samples()
        return self._samples

    @property
    def uids(self) -> list[str]:
        if self._samples is not None:
            return [s.uid for s in self._samples]
        return [uid for uid, _ in self._rows.identities()]

    @property
    def group_ids(self) -> list[str]:
        if self._samples is not None:
            return [s.group_id for s in self._samples]
        return [group_id for _, group_id in self._rows.identities()]

    def column(self, name: str) -> list[np.ndarray]:
        """One token field of every sample as a numpy array (int32 ids and versions, float32
        log-probs); a field put as an array comes back without a copy (read-only)."""
        if name not in TOKEN_FIELDS:
            raise ValueError(f"{name!r} is not a token field; token fields are {tuple(TOKEN_FIELDS)}")
        return self._rows.column(name, self._samples)
