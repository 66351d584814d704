"""Transports behind one interface, built by one factory: :func:`make_transport`.

``inproc``: same process. ``ray``: buckets through the Ray object store.
``broadcast``: a ``torch.distributed`` broadcast (gloo on CPU, NCCL on GPU).
``cuda_ipc``: CUDA IPC handles for a trainer
and engines on GPUs of one host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, cast, overload

from contracts.weights import WeightUpdate
from sync.transport.base import Transport

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from sync.transport.broadcast import BroadcastTransport

__all__ = ["Transport", "TransportName", "make_transport", "transport_class"]

#: The transports by name (``sync.transport``, ``auto`` aside).
TransportName = Literal["inproc", "cuda_ipc", "broadcast", "ray"]


def transport_class(name: str) -> type[Transport[WeightUpdate]] | type[Transport[None]]:
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


@overload
def make_transport(name: Literal["broadcast"], *,  # type: ignore[overload-overlap]  # a Literal before str
                   device: str | torch.device | None = None, src: int = 0,
                   group: dist.ProcessGroup | None = None,
                   pg: dist.ProcessGroupGloo | None = None) -> BroadcastTransport: ...


@overload
def make_transport(name: str, *, device: str | torch.device | None = None, src: int = 0,
                   group: dist.ProcessGroup | None = None,
                   pg: dist.ProcessGroupGloo | None = None) -> Transport[WeightUpdate]: ...


def make_transport(name: str, *, device: str | torch.device | None = None, src: int = 0,
                   group: dist.ProcessGroup | None = None,
                   pg: dist.ProcessGroupGloo | None = None) -> Transport[WeightUpdate] | BroadcastTransport:
    """The transport called ``name`` (see :func:`transport_class`), for one side
    of a push: the one place a transport is built. ``device``: for
    ``cuda_ipc`` the GPU the buckets live on (the trainer's; default ``cuda``),
    for ``broadcast`` where buckets travel (default by backend); ``src``, ``group``,
    ``pg``: a broadcast's sending rank and process group
    (:class:`~sync.transport.broadcast.BroadcastTransport`)."""
    cls = transport_class(name)
    if name == "cuda_ipc":
        from sync.transport.cuda_ipc import CudaIpcTransport

        device = "cuda" if device is None else device
        if getattr(device, "type", str(device).split(":")[0]) != "cuda":
            raise ValueError(f"sync.transport=cuda_ipc needs the trainer on a GPU, it is on {device}")
        return CudaIpcTransport(device)
    if name == "broadcast":
        from sync.transport.broadcast import BroadcastTransport

        return BroadcastTransport(src=src, group=group, device=device, pg=pg)
    return cast("type[Transport[WeightUpdate]]", cls)()
