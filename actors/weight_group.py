"""Weight sync between actors in different processes over ``torch.distributed``.

The trainer (rank 0) and every rollout actor (ranks 1..R) join one process
group at setup. A push is a broadcast: the driver's sync sequence asks the
trainer for the update and gets back only its manifest (the payload stays in
the trainer's process); the :class:`ActorBroadcast` transport then starts the
trainer's broadcast while every rollout actor receives it, verifies the
checksums and applies it (``update_weights(DistPush)``)::

    driver (sync.sequence)          trainer (rank 0)              rollout i (rank i)
    weight_update() ───────────────► encode, keep payload
                   ◄── manifest only
    transport.send ────────────────► broadcast_pending() ═══════► update_weights(DistPush)
                                                                   receive → apply → version

gloo on CPU, NCCL between GPUs (``sync.transport=broadcast``).
"""

from __future__ import annotations

import asyncio
import datetime
import socket
from typing import Any

import msgspec

from sync.transport.base import Transport

__all__ = ["DistPush", "ActorBroadcast", "digest_named", "free_port", "join_group"]

_TIMEOUT = datetime.timedelta(seconds=120)  # a peer that died makes a broadcast fail, not hang


class DistPush(msgspec.Struct, frozen=True):
    """Handle of one broadcast push: receivers take the update from the group."""

    version: int


def digest_named(tensors: dict[str, Any]) -> dict[str, str]:
    """sha256 of each tensor's bytes, by name: equal digests mean bit-identical weights."""
    import hashlib

    import torch

    out = {}
    for name, t in tensors.items():
        flat = t.detach().contiguous().cpu().reshape(-1)
        out[name] = hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_group(init_method: str, rank: int, world_size: int, backend: str) -> Any:
    """Join the weight-sync process group (blocking; call on the actor's worker
    thread, every member at once). Returns the broadcast transport rooted at rank 0."""
    import torch.distributed as dist

    from sync.transport.dist import BroadcastTransport

    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=_TIMEOUT)
    return BroadcastTransport(src=0)


class ActorBroadcast(Transport):
    """Driver-side transport for the sync sequence: ``send`` starts the
    trainer's broadcast; receivers are the rollout actors themselves. Every
    push goes to all members of the group (a broadcast cannot skip one)."""

    name = "broadcast"

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._task: asyncio.Task[Any] | None = None

    def send(self, update: Any) -> DistPush:
        if self._task is not None and not self._task.done():
            raise RuntimeError("a broadcast push is still running")
        self._task = asyncio.get_running_loop().create_task(self.trainer.broadcast_pending())
        return DistPush(version=update.manifest.version)

    def receive(self, handle: Any) -> Any:
        raise RuntimeError("ActorBroadcast: the rollout actors receive, not the driver")

    def release(self, handle: Any) -> None:
        task, self._task = self._task, None
        if task is not None and task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    async def wait(self) -> None:
        """Wait for the trainer's side of the last push (re-raises its error)."""
        task, self._task = self._task, None
        if task is not None:
            await task
