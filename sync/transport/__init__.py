"""Transports behind one interface, picked by name with :func:`make_transport`.

``inproc``: same process. ``ray``: buckets through the Ray object store.
``dist``: ``torch.distributed`` broadcast (gloo on CPU, NCCL on GPU).
``cuda_ipc``: CUDA IPC handles for a trainer and engine sharing a GPU.
"""

from __future__ import annotations

from typing import Any

from sync.transport.base import Transport

__all__ = ["Transport", "make_transport"]


def make_transport(name: str, **kwargs: Any) -> Transport:
    """Build the transport called ``name`` (``inproc``, ``ray``, ``dist``, ``cuda_ipc``)."""
    if name == "inproc":
        from sync.transport.inproc import InProcessTransport

        return InProcessTransport(**kwargs)
    if name == "ray":
        from sync.transport.ray_store import RayObjectStoreTransport

        return RayObjectStoreTransport(**kwargs)
    if name == "dist":
        from sync.transport.dist import BroadcastTransport

        return BroadcastTransport(**kwargs)
    if name == "cuda_ipc":
        from sync.transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(**kwargs)
    raise ValueError(f"unknown transport {name!r}; expected one of 'inproc', 'ray', 'dist', 'cuda_ipc'")
