"""A receiver's view of one manifest entry: its elements of a receiver tensor.

Every path that writes an update into an engine's tensors reaches them through
a :class:`Piece`: the generic apply (:mod:`sync.apply`), the codec's sparse
writes (:mod:`sync.codec`) and the planned receivers (:mod:`sync.device`,
:mod:`sync.device_delta`). Building one checks the entry against the
receiver: the name, the shape, a dtype that holds the sent values exactly,
the range.
"""

from __future__ import annotations

import numpy as np
import torch

from contracts.weights import TensorEntry, dtype_from_name
from sync import checksum as cks
from sync.errors import ManifestMismatch

_WIDER = {
    torch.bfloat16: {torch.float32, torch.float64},
    torch.float16: {torch.float32, torch.float64},
    torch.float32: {torch.float64},
}


def _holds_exactly(receiver: torch.dtype, sent: torch.dtype) -> bool:
    return receiver == sent or receiver in _WIDER.get(sent, set())


class Piece:
    """Read/write access to one entry's elements of a receiver tensor, in the
    entry's dtype, addressed by piece-local flat index."""

    def __init__(self, weights: dict[str, torch.Tensor], e: TensorEntry) -> None:
        w = weights.get(e.name)
        if w is None:
            raise ManifestMismatch(f"receiver has no tensor named {e.name!r}")
        if tuple(w.shape) != tuple(e.shape):
            raise ManifestMismatch(f"{e.name}: receiver shape {tuple(w.shape)} != manifest shape {tuple(e.shape)}")
        self.dtype = dtype_from_name(e.dtype)
        if not _holds_exactly(w.dtype, self.dtype):
            raise ManifestMismatch(f"{e.name}: receiver dtype {w.dtype} cannot hold {self.dtype} values exactly")
        self.entry = e
        self.device = w.device
        region = w if e.shard is None else w.narrow(e.shard.dim, e.shard.offset, e.shard.length)
        if e.start < 0 or e.count < 0 or e.start + e.count > region.numel():
            raise ManifestMismatch(f"{e.name}: piece [{e.start}, {e.start + e.count}) out of range")
        if region.is_contiguous():
            self._flat, self._base = region.view(-1), e.start
            self._positions = None
        else:
            if not w.is_contiguous():
                raise ManifestMismatch(f"{e.name}: receiver tensor must be contiguous for a sharded update")
            self._flat, self._base = w.view(-1), 0
            self._positions = e.shard  # map piece indices through the shard spec

    def np_piece(self) -> np.ndarray | None:
        """The piece as a writable numpy integer view when it is on the CPU,
        contiguous in the full tensor and held in the entry's dtype (the C
        kernels write into it); None otherwise."""
        e = self.entry
        if self.device.type != "cpu" or self._positions is not None or self._flat.dtype != self.dtype:
            return None
        if e.shard is not None and not e.shard.is_contiguous:
            return None
        return cks.int_view(self._flat).numpy()[self._base : self._base + e.count]

    def region_view(self) -> torch.Tensor | None:
        """The piece's elements as a view of the receiver tensor when they are
        contiguous there and held in the entry's dtype; None otherwise."""
        if self._positions is not None or self._flat.dtype != self.dtype:
            return None
        return self._flat[self._base : self._base + self.entry.count]

    def _index(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx.to(self.device) + self.entry.start
        return local if self._positions is None else self._positions.global_positions(local)

    def read_all(self) -> torch.Tensor:
        if self._positions is None:
            return self._flat[self._base : self._base + self.entry.count].to(self.dtype)
        return self.read(torch.arange(self.entry.count, device=self.device))

    def write_all(self, values: torch.Tensor) -> None:
        if self._positions is None:
            self._flat[self._base : self._base + self.entry.count].copy_(values)
        else:
            self.write(torch.arange(self.entry.count, device=self.device), values)

    def _pos(self, idx: torch.Tensor) -> torch.Tensor:
        return self._index(idx) if self._positions is not None else idx.to(self.device) + self._base

    def _np_piece(self, idx: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(integer numpy view to index, indices into it) on CPU: slicing the
        piece out is free, adding its offset to every index is not."""
        if self._positions is None:
            flat = cks.int_view(self._flat).numpy()[self._base : self._base + self.entry.count]
            return flat, idx.numpy()
        return cks.int_view(self._flat).numpy(), self._index(idx).numpy()

    def read(self, idx: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":  # numpy's gather is several times faster than torch's on CPU
            flat, at = self._np_piece(idx)
            return torch.from_numpy(flat[at]).view(self._flat.dtype).to(self.dtype)
        return self._flat[self._pos(idx)].to(self.dtype)

    def write(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        values = values.to(device=self.device, dtype=self._flat.dtype)
        if self.device.type == "cpu":
            flat, at = self._np_piece(idx)
            flat[at] = cks.int_view(values).numpy()
        else:
            self._flat[self._pos(idx)] = values
