"""CUDA IPC transport for a trainer and an engine in different processes on
the same GPU: buckets stay in the trainer's GPU memory and the engine maps
them (``torch.multiprocessing.reductions.reduce_tensor``), so a push is one
device-to-device copy inside ``apply_update``.

The sender must keep the buckets alive until every receiver has applied:
:meth:`send` holds them and :meth:`release` lets them go.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from contracts.weights import WeightUpdate, bucket_tensor
from sync.transport.base import Transport


class CudaIpcBucket:
    """A picklable reference to a uint8 CUDA buffer in another process."""

    __slots__ = ("rebuild", "args")

    def __init__(self, rebuild: Any, args: tuple) -> None:
        self.rebuild, self.args = rebuild, args

    def materialize(self) -> torch.Tensor:
        return self.rebuild(*self.args)


class CudaIpcTransport(Transport):
    """``device``: the GPU the buckets live on (they are moved there if not)."""

    name = "cuda_ipc"

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        self._alive: dict[int, list[torch.Tensor]] = {}

    def send(self, update: WeightUpdate) -> WeightUpdate:
        tensors = [bucket_tensor(b).to(self.device) for b in update.buckets]
        handle = WeightUpdate(manifest=update.manifest, buckets=[CudaIpcBucket(*reduce_tensor(t)) for t in tensors])
        self._alive[id(handle)] = tensors
        return handle

    def receive(self, handle: WeightUpdate) -> WeightUpdate:
        return WeightUpdate(manifest=handle.manifest, buckets=[b.materialize() for b in handle.buckets])

    def release(self, handle: WeightUpdate) -> None:
        self._alive.pop(id(handle), None)

    def close(self) -> None:
        self._alive.clear()
