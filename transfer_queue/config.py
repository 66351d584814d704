"""TransferQueueConfig: the one typed config of a TransferQueue deployment."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

__all__ = ["TransferQueueConfig"]

Deployment = Literal["local", "ray"]


class TransferQueueConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How big the queue is, how it is sharded, and how long a consumer may hold a batch.

    Every field is checked on construction (``ValueError`` naming the field).
    """

    # Most samples resident at once (pending + leased, partial ones included).
    # ``put`` waits (or raises QueueFull with wait=False) rather than exceed it.
    capacity: int = 8192
    # Storage units the sample data is sharded across (global index % num_storage_units).
    num_storage_units: int = 2
    # Seconds a consumer may hold a batch before it is returned to the ready set
    # (its consumer is presumed dead). ``math.inf`` means leases never expire.
    lease_s: float = 600.0
    # "local": controller and storage units live in this process (default; tests).
    # "ray": they are Ray actors; data moves client <-> storage unit directly.
    deployment: Deployment = "local"
    # Ray only: the CPUs each controller / storage-unit actor reserves. 0 lets them
    # share a small machine with the rollout and trainer actors.
    ray_num_cpus: float = 0.0
    # Ray only: the TCP ports (first, last) the controller and storage units listen
    # on, each taking the first free one on its node; None: any free port. For a
    # cluster whose firewall opens only a range between nodes.
    ports: tuple[int, int] | None = None

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
        if self.ports is not None and not (
            isinstance(self.ports, (tuple, list)) and len(self.ports) == 2
            and all(isinstance(p, int) for p in self.ports) and 1 <= self.ports[0] <= self.ports[1] <= 65535
        ):
            raise ValueError(f"ports must be (first, last) with 1 <= first <= last <= 65535, got {self.ports!r}")
