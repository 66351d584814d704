"""Transports behind one interface, picked by name with :func:`make_transport`.

``inproc``: same process. ``ray``: buckets through the Ray object store.
``dist``: ``torch.distributed`` broadcast (gloo on CPU, NCCL on GPU).
``cuda_ipc``: CUDA IPC handles for a trainer and engine sharing a GPU.
"""

from __future__ import annotations

from typing import Any

from sync.transport.base import Transport

__all__ = ["Transport", "make_transport", "transport_class"]


def transport_class(name: str) -> type[Transport]:
    """The transport class called ``name`` (``inproc``, ``ray``, ``dist``, ``cuda_ipc``)."""
    if name == "inproc":
        from sync.transport.inproc import InProcessTransport

        return InProcessTransport
    if name == "ray":
        from sync.transport.ray_store import RayObjectStoreTransport

        return RayObjectStoreTransport
    if name == "dist":
        from sync.transport.dist import BroadcastTransport

        return BroadcastTransport
    if name == "cuda_ipc":
        from sync.transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport
    raise ValueError(f"unknown transport {name!r}; expected one of 'inproc', 'ray', 'dist', 'cuda_ipc'")


def make_transport(name: str, **kwargs: Any) -> Transport:
    """Build the transport called ``name`` (see :func:`transport_class`)."""
    return transport_class(name)(**kwargs)
