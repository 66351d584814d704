"""CUDA IPC transport for a trainer and an engine in different processes on
the same GPU: buckets stay in the trainer's GPU memory and the engine maps
them (``torch.multiprocessing.reductions.reduce_tensor``), so a push is one
device-to-device copy inside ``apply_update``.

Each storage behind the buckets is shared once per push (a planned update's
buckets are views of one storage: one handle). A planned update's storage
(``manifest.layout``) is refilled by the sender every sync, so it is shared
once for good: the sender keeps its handle and every receiver keeps it mapped,
and later pushes open nothing. Other updates' storages are shared per push and
let go once applied.

The sender must keep the buckets alive until every receiver has applied:
:meth:`send` holds them and :meth:`release` lets them go.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch.multiprocessing.reductions import reduce_tensor

from contracts.weights import Bucket, WeightUpdate, bucket_tensor
from sync.transport.base import Transport

_KEPT: dict[tuple[object, object], torch.Tensor] = {}  # receiver side: storages of planned updates, by IPC handle
_MAX_KEPT = 2  # the current plan's storage and its delta payload; those a new plan replaced are let go


class SharedStorage:
    """A picklable reference to a CUDA storage in another process (the whole
    storage as a uint8 tensor); materialised once per receiving process and push."""

    __slots__ = ("rebuild", "args", "keep", "_tensor")

    def __init__(self, rebuild: Callable[..., torch.Tensor], args: tuple[object, ...], keep: bool) -> None:
        self.rebuild, self.args, self.keep = rebuild, args, keep
        self._tensor: torch.Tensor | None = None

    def __getstate__(self) -> tuple:
        return self.rebuild, self.args, self.keep

    def __setstate__(self, state: tuple) -> None:
        self.rebuild, self.args, self.keep = state
        self._tensor = None

    def materialize(self) -> torch.Tensor:
        if self._tensor is None:
            key = (self.args[7], self.args[9])  # (storage handle, offset in it)
            kept = _KEPT.get(key) if self.keep else None
            # mapped on an earlier push: the same handle, shared once by the sender, opens nothing
            self._tensor = kept if kept is not None else self.rebuild(*self.args)
            if self.keep and kept is None:
                _KEPT[key] = self._tensor
                while len(_KEPT) > _MAX_KEPT:
                    _KEPT.pop(next(iter(_KEPT)))
        return self._tensor


class CudaIpcBucket:
    """One bucket: ``nbytes`` at ``offset`` of a :class:`SharedStorage`."""

    __slots__ = ("storage", "offset", "nbytes")

    def __init__(self, storage: SharedStorage, offset: int, nbytes: int) -> None:
        self.storage, self.offset, self.nbytes = storage, offset, nbytes

    def __getstate__(self) -> tuple:
        return self.storage, self.offset, self.nbytes

    def __setstate__(self, state: tuple) -> None:
        self.storage, self.offset, self.nbytes = state

    def materialize(self) -> torch.Tensor:
        return self.storage.materialize()[self.offset : self.offset + self.nbytes]


class CudaIpcTransport(Transport[WeightUpdate]):
    """``device``: the GPU the buckets live on (they are moved there if not)."""

    name = "cuda_ipc"
    can_stage = True

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        self._alive: dict[int, list[torch.Tensor]] = {}
        # planned updates' storages, shared once: (the storage as a tensor, its reference)
        self._shared: dict[int, tuple[torch.Tensor, SharedStorage]] = {}

    def _share(self, t: torch.Tensor, keep: bool) -> tuple[SharedStorage, int]:
        """The reference to ``t``'s whole storage, and the storage's address."""
        storage = t.untyped_storage()
        base = storage.data_ptr()
        cached = self._shared.get(base) if keep else None
        if cached is not None and cached[0].untyped_storage().nbytes() == storage.nbytes():
            return cached[1], base
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
        rebuild, args = reduce_tensor(whole)
        ref = SharedStorage(rebuild, args, keep=keep)
        if keep:  # held here, so the address cannot be reused by another allocation while cached
            self._shared[base] = (whole, ref)
            while len(self._shared) > _MAX_KEPT:
                self._shared.pop(next(iter(self._shared)))
        return ref, base

    def send(self, update: WeightUpdate) -> WeightUpdate:
        tensors = [bucket_tensor(b).to(self.device) for b in update.buckets]
        keep = bool(update.manifest.layout)
        shared: dict[int, tuple[SharedStorage, int]] = {}  # storage address -> (reference, its base address)
        buckets: list[Bucket] = []
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in shared:
                shared[key] = self._share(t, keep)
            ref, base = shared[key]
            buckets.append(CudaIpcBucket(ref, t.data_ptr() - base, t.numel()))
        handle = WeightUpdate(manifest=update.manifest, buckets=buckets)
        self._alive[id(handle)] = tensors
        return handle

    def receive(self, handle: WeightUpdate) -> WeightUpdate:
        return WeightUpdate(manifest=handle.manifest,
                            buckets=[cast(CudaIpcBucket, b).materialize() for b in handle.buckets])

    def release(self, handle: WeightUpdate) -> None:
        self._alive.pop(id(handle), None)

    def close(self) -> None:
        self._alive.clear()
        self._shared.clear()
