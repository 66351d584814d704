"""A sender's payload buckets: uint8 tensors of at most ``bucket_bytes``.

Each blob is written in place once (a raw piece's values are cast straight
into its bucket, a sparse piece's streams copied in), 8-byte aligned so that
receivers view raw pieces in place; a piece is never larger than a bucket.
"""

from __future__ import annotations

import torch

_ALIGN = 8  # raw pieces start 8-byte aligned so receivers view them in place


class BucketWriter:
    """Packs entry blobs into uint8 buckets of at most ``bucket_bytes``
    (a piece is never larger than that), writing each blob in place once."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.buckets: list[torch.Tensor] = []
        self._cur: torch.Tensor | None = None
        self._used = 0

    def reserve(self, nbytes: int, device: torch.device) -> tuple[int, int, torch.Tensor]:
        """Room for ``nbytes``: (bucket index, offset, the uint8 view to fill)."""
        pad = (-self._used) % _ALIGN
        if self._cur is not None and self._used + pad + nbytes > self._cur.numel():
            self.flush()
            pad = 0
        if self._cur is None:
            self._cur = torch.empty(max(self.bucket_bytes, nbytes), dtype=torch.uint8, device=device)
        self._cur[self._used : self._used + pad].zero_()
        offset = self._used + pad
        self._used = offset + nbytes
        return len(self.buckets), offset, self._cur[offset : self._used]

    def add(self, blob: torch.Tensor) -> tuple[int, int]:
        bucket, offset, view = self.reserve(blob.numel(), blob.device)
        view.copy_(blob)
        return bucket, offset

    def flush(self) -> None:
        if self._cur is not None:
            used = self._cur[: self._used]
            # a mostly empty last bucket should not pin a whole bucket of memory
            self.buckets.append(used.clone() if self._used < self._cur.numel() // 2 else used)
        self._cur, self._used = None, 0
