"""Transports behind one interface, built by one factory: :func:`make_transport`.

``inproc``: same process. ``ray``: buckets through the Ray object store.
``broadcast``: a ``torch.distributed`` broadcast (gloo on CPU, NCCL on GPU).
``cuda_ipc``: CUDA IPC handles for a trainer
and engines on GPUs of one host.
"""

from __future__ import annotations

from typing import Any

from sync.transport.base import Transport

__all__ = ["Transport", "make_transport", "transport_class"]


def transport_class(name: str) -> type[Transport]:
    """The transport class called ``name`` (``inproc``, ``ray``, ``broadcast``, ``cuda_ipc``)."""
    if name == "inproc":
        from sync.transport.inproc import InProcessTransport

        return InProcessTransport
    if name == "ray":
        from sync.transport.ray_store import RayObjectStoreTransport

        return RayObjectStoreTransport
    if name == "broadcast":
        from sync.transport.broadcast import BroadcastTransport

        return BroadcastTransport
    if name == "cuda_ipc":
        from sync.transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport
    raise ValueError(f"unknown transport {name!r}; expected one of 'inproc', 'ray', 'dist', 'cuda_ipc'")


def make_transport(name: str, *, device: Any = None, src: int = 0, group: Any = None, pg: Any = None) -> Transport:
    """The transport called ``name`` (see :func:`transport_class`), for one side
    of a push: the one place a transport is built. ``device``: for
    ``cuda_ipc`` the GPU the buckets live on (the trainer's; default ``cuda``),
    for ``broadcast`` where buckets travel (default by backend); ``src``, ``group``,
    ``pg``: a broadcast's sending rank and process group
    (:class:`~sync.transport.broadcast.BroadcastTransport`)."""
    cls: Any = transport_class(name)
    if name == "cuda_ipc":
        device = "cuda" if device is None else device
        if getattr(device, "type", str(device).split(":")[0]) != "cuda":
            raise ValueError(f"sync.transport=cuda_ipc needs the trainer on a GPU, it is on {device}")
        return cls(device)
    if name == "broadcast":
        return cls(src=src, group=group, device=device, pg=pg)
    return cls()
