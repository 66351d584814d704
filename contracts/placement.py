"""Where an actor runs, as the composition root and the transports see it."""

from __future__ import annotations

import os
import socket
import sys
import types

import msgspec

__all__ = ["Placement", "node_address", "placement"]


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """An actor's process, its node (Ray's node id, else the host name) and its
    device (``cpu`` / ``cuda[:i]``)."""

    pid: int
    node: str
    device: str


def _ray() -> types.ModuleType | None:
    # Ray is connected only where something imported it: a local run never pays for
    # importing it (seconds, and in a notebook a log line about ipywidgets)
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def node_address() -> str:
    """The address other nodes reach this process's node at (Ray's view of it
    inside a Ray worker or driver; loopback for the processes of one host)."""
    ray = _ray()
    return ray.util.get_node_ip_address() if ray is not None else "127.0.0.1"


def placement(device: str) -> Placement:
    """This process's placement, for an actor computing on ``device``."""
    ray = _ray()
    node = ray.get_runtime_context().get_node_id() if ray is not None else socket.gethostname()
    return Placement(pid=os.getpid(), node=node, device=device)
