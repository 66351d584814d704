"""The weight link between a trainer and its engines: which transport, and
the three places that use it.

    driver (control only)            trainer process               engine processes
    open_weight_link(trainer, rollouts, cfg.sync)
      choose_transport(placements) ► TrainerLink(kind)  ──────────► EngineLink(kind)
      [broadcast] one broadcast group: trainer workers ranks 0..n-1, rollout i rank n+i
    reform_weight_link(...)          the same group again, without a dead rollout actor
    push_weights(rollouts, trainer)
      trainer.weight_update() ─────► encode, publish: the payload
                  ◄── manifest + small handle (never the buckets)
      rollout.update_weights(handle) ────────────────────────────► receive(handle) → apply
      [broadcast] trainer.broadcast_pending() ═══ broadcast ═══════════► (received in step)
      trainer.release_weights() ───► published buffers freed

The transport follows placement (:func:`choose_transport`), with no flag
needed: the same process → ``inproc`` (a process-local registry: what crosses
the policy is a key); another process on the same host's GPUs → ``cuda_ipc``
(engines map the trainer's buckets); other hosts or CPU processes → ``broadcast``
(a torch.distributed broadcast, NCCL between GPUs, gloo otherwise, rendezvous
on the trainer's node address); Ray's object store (``ray``) when
torch.distributed is unavailable. ``sync.transport`` can force one.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import hashlib
import socket
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, cast

from contracts.handles import RolloutHandle, TrainerHandle
from contracts.placement import Placement, node_address
from contracts.rollout import InFlight
from contracts.weights import BroadcastPush, WeightHandle, WeightUpdate, merge_updates
from sync.config import SyncConfig
from sync.metrics import SyncResult
from sync.sequence import sync_weights
from sync.transport import Transport, TransportName, make_transport, transport_class
from sync.transport.base import H

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from sync.transport.broadcast import BroadcastTransport

__all__ = ["BroadcastPush", "EngineLink", "TrainerLink", "WeightGroupLost", "WeightSync", "choose_transport",
           "digest_named", "open_weight_link", "push_weights", "reform_weight_link", "weight_sync_fn"]

Kind = TransportName
_TIMEOUT = datetime.timedelta(seconds=120)  # a peer that died makes a broadcast fail, not hang


def choose_transport(trainer: Placement, engines: list[Placement], forced: str = "auto") -> Kind:
    """The transport for this placement (``forced``, ``sync.transport``, when not ``auto``)."""
    if forced != "auto":
        return cast(Kind, forced)
    if all(e.pid == trainer.pid for e in engines):
        return "inproc"
    on_gpu = trainer.device.startswith("cuda") and all(e.device.startswith("cuda") for e in engines)
    if on_gpu and all(e.node == trainer.node for e in engines):
        return "cuda_ipc"
    import torch.distributed as dist

    return "broadcast" if dist.is_available() else "ray"


def digest_named(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's bytes, by name: equal digests mean bit-identical weights."""
    import torch

    out = {}
    for name, t in tensors.items():
        flat = t.detach().contiguous().cpu().reshape(-1)
        out[name] = hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


_LISTENING: list[socket.socket] = []  # the stores' own sockets: closing one would end its store


def _tcp_store(host: str, port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    """The group's rendezvous store. Its master listens on ``host`` only: given a
    host, torch's store still binds every interface, so it gets a socket bound here."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=_TIMEOUT)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    _LISTENING.append(sock)
    del _LISTENING[:-4]  # a group re-forms seldom: those of earlier groups are long gone
    return dist.TCPStore(host, port, world_size, True, timeout=_TIMEOUT, master_listen_fd=sock.fileno())


def _join_group(init_method: str, rank: int, world_size: int, backend: str) -> dist.ProcessGroupGloo | None:
    """Join the weight-sync process group (blocking: every member at once).
    Over gloo it is a group of its own, not the default one (data-parallel
    trainers have theirs); ``None`` means the default group (NCCL)."""
    import torch.distributed as dist

    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    store = _tcp_store(host.strip("[]"), int(port), world_size, rank == 0)
    if backend == "gloo":
        return dist.ProcessGroupGloo(dist.PrefixStore("asyncrl/weights", store), rank, world_size, _TIMEOUT)
    if dist.is_initialized():
        raise RuntimeError("a weight broadcast over NCCL needs the default process group of its own; "
                           "data-parallel trainers on GPUs of one host push over CUDA IPC (sync.transport=auto)")
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=_TIMEOUT)
    return None


def _broadcasts(group: dist.ProcessGroupGloo | None, sources: int) -> list[BroadcastTransport]:
    """One broadcast transport per sending rank (the trainer workers are ranks 0..sources-1)."""
    return [make_transport("broadcast", src=s, pg=group) for s in range(sources)]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TrainerLink:
    """The trainer's end: publishes each encoded update and keeps its payload
    until :meth:`release` (every engine has applied it)."""

    def __init__(self, kind: Kind, device: str | torch.device = "cpu") -> None:
        self.kind = kind
        self.collective = transport_class(kind).collective  # the payload goes in a broadcast to a group
        self._group: list[BroadcastTransport] | None = None  # a collective's transports, one a sender: made when joined
        self._pending: WeightUpdate | None = None  # a collective's update waiting to be sent
        self._published: list[WeightUpdate] = []
        self._transport: Transport[WeightUpdate] | None = None if self.collective else make_transport(
            kind, device=device)

    @staticmethod
    def rendezvous() -> str:
        """A ``tcp://`` address on this node for the broadcast group to meet at."""
        host = node_address()
        return f"tcp://{host}:{_free_port(host)}"

    def join(self, init_method: str, world_size: int, backend: str, rank: int = 0, sources: int = 1) -> None:
        """As rank ``rank`` of ``sources`` trainer workers, each sending its shards in turn."""
        self._rank = rank
        self._group = _broadcasts(_join_group(init_method, rank, world_size, backend), sources)

    def publish(self, update: WeightUpdate | None) -> WeightUpdate | None:
        """What the engines need to fetch ``update``: its manifest and references
        to its buckets (over a collective, the manifest only: the payload is broadcast)."""
        if update is None:
            return None
        if self._transport is None:
            self._pending = update
            return WeightUpdate(manifest=update.manifest, buckets=[])
        handle = self._transport.send(update)
        self._published.append(handle)
        return handle

    def broadcast_pending(self) -> int:
        """Broadcast the last published update to the group (blocking); returns its bytes."""
        if self._pending is None:
            raise RuntimeError("broadcast_pending() without an update published before it")
        update, self._pending = self._pending, None
        assert self._group is not None, "broadcast_pending() before join()"
        for src, transport in enumerate(self._group):  # every worker takes part in every worker's broadcast
            if src == self._rank:
                transport.send(update)
            else:
                transport.receive()
        return update.nbytes

    def release(self) -> None:
        published, self._published = self._published, []
        for handle in published:
            assert self._transport is not None
            self._transport.release(handle)


class EngineLink:
    """An engine's end: turns the handle the policy passed on into the update."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        # the payload comes in a broadcast to the group: received in step, never checked ahead
        self.collective = transport_class(kind).collective
        self._group: list[BroadcastTransport] | None = None

    def join(self, init_method: str, rank: int, world_size: int, backend: str, sources: int = 1) -> None:
        """``sources``: trainer workers (ranks 0..sources-1) that each broadcast their shards."""
        self._group = _broadcasts(_join_group(init_method, rank, world_size, backend), sources)

    def receive(self, handle: WeightHandle) -> WeightUpdate:
        """Blocking for a :class:`BroadcastPush` (takes part in the broadcast: every
        trainer worker's shards, merged); the others' buckets are references that
        ``apply_update`` reads as it goes."""
        if isinstance(handle, BroadcastPush):
            if self._group is None:
                raise RuntimeError("a broadcast push reached an engine outside the weight group")
            parts = [t.receive() for t in self._group]
            return parts[0] if len(parts) == 1 else merge_updates(parts)
        return handle


class _ActorPush(Transport[WeightHandle]):
    """The policy's side of a push (a :class:`~sync.transport.base.Transport` for
    :func:`sync.sequence.sync_weights`): the handle goes on to the engines as
    it is; over a collective it starts the trainer's broadcast beside their receives."""

    name = "actor"

    def __init__(self, trainer: TrainerHandle, kind: Kind) -> None:
        self.trainer, self.kind = trainer, kind
        cls = transport_class(kind)
        self.can_stage = cls.can_stage  # the engines check ahead where that transport lets them
        self.collective = cls.collective
        self._task: asyncio.Task[int] | None = None

    def send(self, update: WeightUpdate) -> WeightHandle:
        if not self.collective:
            return update
        if self._task is not None and not self._task.done():
            raise RuntimeError("a broadcast push is still running")
        self._task = asyncio.get_running_loop().create_task(self.trainer.broadcast_pending())
        return BroadcastPush(version=update.manifest.version)

    def receive(self, handle: WeightHandle) -> WeightUpdate:
        raise RuntimeError("the engines receive, not the policy")

    def release(self, handle: WeightHandle) -> None:
        task = self._task
        if task is not None and task.done() and (err := task.exception()) is not None:
            self._task = None
            raise err

    async def wait(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await task


class WeightGroupLost(RuntimeError):
    """A broadcast group that cannot be formed again without a member that died."""


async def open_weight_link(trainer: TrainerHandle, engines: Sequence[RolloutHandle], cfg: SyncConfig,
                           sources: int = 1) -> tuple[Kind, Literal["full", "delta"]]:
    """Pick the weight transport from where the trainer and ``engines`` (rollout
    actor handles) run (``cfg.transport`` can force one), open it at both ends
    and, for a broadcast, form its group (``cfg.backend``; ``auto``: NCCL when
    every member is on a GPU, else gloo); returns the transport's name and the
    kind pushed over it after the first full push (``cfg.mode``, ``auto``
    resolved as the trainer resolves it: ``sync.auto.mode_for``).
    ``sources``: the trainer workers, each broadcasting its shards."""
    where = await asyncio.gather(trainer.placement(), *(h.placement() for h in engines))
    kind = choose_transport(where[0], list(where[1:]), cfg.transport)
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if all(p.device.startswith("cuda") for p in where) else "gloo"
    await _form_weight_link(trainer, engines, kind, backend, sources)
    return kind, cfg.mode_for(kind, where[0].device)


async def reform_weight_link(trainer: TrainerHandle, engines: Sequence[RolloutHandle],
                             link: tuple[str, str | None, int] | None) -> None:
    """After a rollout actor died: a broadcast group of fixed members would wait
    for it at every push, so the trainer and ``engines`` (the live actors and
    those joining) form a new one. ``link``: how the actors were linked (a
    rollout actor's ``weight_link()``; None: asked of ``engines``). Other
    transports have no membership: nothing to do. Raises
    :class:`WeightGroupLost` when the group cannot be formed again here (NCCL)."""
    if link is None:  # died before the first step asked: a live original still knows
        links = [x for x in await asyncio.gather(*(h.weight_link() for h in engines)) if x is not None]
        link = next((x for x in links if x[1] is not None), links[0] if links else None)
    if link is None or not transport_class(link[0]).collective:
        return
    kind, backend, sources = link
    if backend == "nccl":
        raise WeightGroupLost("an NCCL weight group cannot be re-formed without it in this process")
    assert backend is not None, "a collective link without its group's backend"
    await _form_weight_link(trainer, engines, cast(Kind, kind), backend, sources)


async def _form_weight_link(trainer: TrainerHandle, engines: Sequence[RolloutHandle], kind: Kind, backend: str,
                            sources: int) -> None:
    """Open ``kind`` at the trainer and every engine; for ``broadcast``, form the
    broadcast group: the ``sources`` trainer workers are ranks 0..sources-1,
    engine i is rank sources + i, and every member joins at once (each join
    blocks until all have). The one place a weight group is formed."""
    init = await trainer.open_weight_link(kind)
    await asyncio.gather(*(h.open_weight_link(kind) for h in engines))
    if transport_class(kind).collective:
        assert init is not None, "the trainer named no rendezvous for its weight group"
        world = sources + len(engines)
        await asyncio.gather(trainer.join_weight_group(init, world, backend),
                             *(h.join_weight_group(init, sources + i, world, backend, sources)
                               for i, h in enumerate(engines)))


async def push_weights(rollouts: Sequence[RolloutHandle], trainer: TrainerHandle,
                       released: asyncio.Event | None = None, *,
                       kind: Kind, colocated: bool, in_flight: InFlight = "abort") -> SyncResult:
    """One weight sync, driven from the policy with control messages only
    (:func:`sync.sequence.sync_weights` over the actors' handles)."""
    transport = _ActorPush(trainer, kind)
    try:
        # a collective cannot check ahead, and a dead member would hold it to the group's timeout:
        # its first round asks every engine its version instead, which finds a dead one at once
        return await sync_weights(rollouts, trainer, colocated=colocated, in_flight=in_flight, transport=transport,
                                  released=None if transport.collective else released,
                                  ask_versions=transport.collective)
    finally:
        try:
            await transport.wait()
        finally:
            await trainer.release_weights()
            if released is not None:
                released.set()


class WeightSync(Protocol):
    """The policy's ``weight_sync``: one push to ``rollouts`` from ``trainer``;
    sets ``released`` once the trainer may step again."""

    def __call__(self, rollouts: Sequence[RolloutHandle], trainer: TrainerHandle,
                 released: asyncio.Event | None = None) -> Awaitable[SyncResult]: ...


def weight_sync_fn(kind: Kind, colocated: bool, in_flight: InFlight = "abort") -> WeightSync:
    """``push_weights`` bound to a transport kind: the policy's ``weight_sync``."""
    return functools.partial(push_weights, kind=kind, colocated=colocated, in_flight=in_flight)
