"""``torch.distributed`` broadcast transport (gloo on CPU, NCCL on GPU).

A collective: the rank that holds the update calls :meth:`send`, every
other rank of the group calls :meth:`receive` at the same time. The manifest
goes first (length, then msgpack bytes), then each bucket, so receivers
allocate exactly the announced sizes. Sharded trainers use one transport per
source rank (``src=r``) and merge the updates (:func:`sync.merge_updates`).
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from contracts.weights import Bucket, Manifest, WeightUpdate, bucket_tensor
from sync.transport.base import Transport


class BroadcastTransport(Transport[None]):
    """``src``: the sending rank; ``group``: process group (None = world);
    ``pg``: instead, a gloo group made on its own (``sync.link``), not
    registered with torch.distributed; ``device``: where buckets travel
    (``cpu`` for gloo, ``cuda`` for NCCL; default: cuda when the backend is nccl)."""

    name = "broadcast"
    collective = True

    def __init__(self, src: int = 0, group: dist.ProcessGroup | None = None,
                 device: str | torch.device | None = None, pg: dist.ProcessGroupGloo | None = None) -> None:
        if pg is None and not dist.is_initialized():
            raise RuntimeError("BroadcastTransport needs torch.distributed to be initialised first")
        self.src, self.group, self.pg = src, group, pg
        if device is None:
            device = "cpu" if pg is not None or dist.get_backend(group) != "nccl" else "cuda"
        self.device = torch.device(device)

    def _bcast(self, t: torch.Tensor) -> None:
        if self.pg is None:
            dist.broadcast(t, src=self.src, group=self.group)
            return
        opts = dist.BroadcastOptions()  # a gloo group of its own (sync.link): called on directly
        opts.rootRank = self.src
        self.pg.broadcast([t], opts).wait()  # type: ignore[attr-defined]  # missing from torch's stub of Backend

    def send(self, update: WeightUpdate) -> None:
        wire = msgspec.msgpack.encode(update.manifest)
        self._bcast(torch.tensor([len(wire)], dtype=torch.int64, device=self.device))
        self._bcast(torch.frombuffer(bytearray(wire), dtype=torch.uint8).to(self.device))
        for b in update.buckets:
            t = bucket_tensor(b)
            if t.device != self.device or not t.is_contiguous():
                t = t.to(self.device).contiguous()
            self._bcast(t)
        return None

    def receive(self, handle: None = None) -> WeightUpdate:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(length)
        wire = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        self._bcast(wire)
        manifest = msgspec.msgpack.decode(wire.cpu().numpy().tobytes(), type=Manifest)
        buckets: list[Bucket] = []
        for size in manifest.bucket_sizes:
            t = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._bcast(t)
            buckets.append(t)
        return WeightUpdate(manifest=manifest, buckets=buckets)
