"""TransferQueueConfig: the one typed config of a TransferQueue deployment,
and the ``transfer_queue`` section of a run's config.

Every field is checked twice: by its bound when a config file is decoded
(``msgspec.convert``, the error names the dotted key), and on direct
construction (``ValueError`` naming the field).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, TypedDict

import msgspec
from msgspec import Meta

__all__ = ["TransferQueueConfig"]

Deployment = Literal["local", "ray"]
Port = Annotated[int, Meta(ge=1, le=65535)]


class RpcLimits(TypedDict, total=False):
    """The socket transport's bounds, as ``RpcServer`` / ``RpcClient`` keywords (absent: their defaults)."""

    max_frame_bytes: int
    hello_timeout_s: float


class TransferQueueConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How big the queue is, how it is sharded, and how long a consumer may hold a batch."""

    capacity: Annotated[int, Meta(ge=1)] = 4096
    """Samples the TransferQueue holds before ``put`` waits: the most resident at
    once (pending + leased, partial ones included). ``put`` waits (or raises
    QueueFull with wait=False) rather than exceed it."""
    num_storage_units: Annotated[int, Meta(ge=1)] = 2
    """Storage units the sample data is sharded across (global index % num_storage_units)."""
    lease_s: Annotated[float, Meta(gt=0)] = 600.0
    """A batch not acknowledged within this returns to the ready set (its
    consumer is presumed dead). ``.inf`` (``math.inf``): leases never expire."""
    deployment: Deployment = "local"
    """``local``: controller and storage units in one process (the creating
    client's, or a :class:`~transfer_queue.served.QueueHost` actor that serves
    them to other processes). ``ray``: they are Ray actors (needs
    ``runtime.type=ray``); data moves client <-> storage unit directly."""
    ray_num_cpus: Annotated[float, Meta(ge=0)] = 0.0
    """``ray`` only: the CPUs each controller / storage-unit actor reserves. 0 lets
    them share a small machine with the rollout and trainer actors."""
    ports: tuple[Port, Port] | None = None
    """``ray`` only: the TCP ports [first, last] its actors listen on (each
    takes the first free one on its node); null: any free port. For a
    cluster whose firewall opens only a range between nodes."""
    max_frame_bytes: Annotated[int, Meta(ge=1)] = 1 << 30
    """Served over sockets (``transfer_queue/rpc.py``: the ``ray`` deployment, or the
    ``local`` one under the ``process`` and ``ray`` runtimes): the largest message,
    its pickle and buffers (a put's or a batch's rows). Its sender refuses a larger one
    (``FrameTooLarge``) and its receiver closes the connection on it, from its header."""
    hello_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    """Served over sockets: seconds a peer has to complete the authentication
    handshake (each side proves it knows the deployment's secret) before it is dropped."""

    @property
    def rpc_limits(self) -> RpcLimits:
        """The socket transport's bounds, as ``RpcServer`` / ``RpcClient`` keywords."""
        return {"max_frame_bytes": self.max_frame_bytes, "hello_timeout_s": self.hello_timeout_s}

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.num_storage_units < 1:
            raise ValueError(f"num_storage_units must be >= 1, got {self.num_storage_units}")
        if not (self.lease_s > 0 and not math.isnan(self.lease_s)):
            raise ValueError(f"lease_s must be > 0 (math.inf for no expiry), got {self.lease_s}")
        if self.deployment not in ("local", "ray"):
            raise ValueError(f"deployment must be 'local' or 'ray', got {self.deployment!r}")
        if self.ray_num_cpus < 0:
            raise ValueError(f"ray_num_cpus must be >= 0, got {self.ray_num_cpus}")
        if self.max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {self.max_frame_bytes}")
        if not self.hello_timeout_s > 0:
            raise ValueError(f"hello_timeout_s must be > 0, got {self.hello_timeout_s}")
        if self.ports is not None and not (
            isinstance(self.ports, (tuple, list)) and len(self.ports) == 2
            and all(isinstance(p, int) for p in self.ports) and 1 <= self.ports[0] <= self.ports[1] <= 65535
        ):
            raise ValueError(f"ports must be (first, last) with 1 <= first <= last <= 65535, got {self.ports!r}")
