"""The endpoints of the two kinds of actor, as the policy, the weight sync and
the composition root call them: ``await handle.method(...)``.

    RolloutHandle          a rollout actor (``actors.rollout.RolloutActor``)
    TrainerHandle          the trainer: one ``actors.trainer.TrainerActor``, or a
                           ``TrainerGroup`` of several standing in for one
    TrainerWorkerHandle    one trainer worker, as a ``TrainerGroup`` calls it
    WeightReceiver[H]      what the weight-sync sequence drives on an engine's side, taking
                           handles ``H``: a ``RolloutEngine`` (``WeightUpdate``) or a
                           ``RolloutHandle`` (``WeightHandle``: over broadcast, a ``BroadcastPush``)
    WeightSource           what a push takes its update from (the trainer's handle)

A handle (``actors.runtime.Handle``) forwards any public method of its actor
and awaits it, whatever the runtime; these Protocols name the ones that make
the seam, with their signatures. ``tests/test_trainer_workers.py`` checks the
actor classes and ``TrainerGroup`` against them, signature by signature.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol, TypeVar

import torch

from contracts.placement import Placement
from contracts.rollout import GenerateOutput, GroupReport, GroupRequest, InFlight, SwapReport
from contracts.training import BatchRequest, StepReport
from contracts.weights import ShardSpec, WeightHandle, WeightUpdate

__all__ = ["RolloutHandle", "TrainerHandle", "TrainerWorkerHandle", "WeightReceiver", "WeightSource"]

H_contra = TypeVar("H_contra", contravariant=True)


class WeightReceiver(Protocol[H_contra]):
    """An engine's side of a push, as ``sync.sequence.sync_weights`` drives it:
    the engine itself or a rollout actor's handle. ``H_contra``: the handle a
    push passes it (what the push's transport publishes). The sequence reads the
    version of one without ``get_version`` (a stand-in) from its ``version``."""

    async def prepare_swap(self, in_flight: InFlight = "abort") -> list[GenerateOutput] | int:
        """Pause, abort (``abort`` mode), ``sleep(1)``: before a push that frees the KV
        cache. Returns the generations aborted (an engine) or their number (an actor)."""
        ...

    async def stage_weights(self, handle: H_contra) -> bool:
        """Check the update behind ``handle`` while still generating; False: not checked ahead."""
        ...

    async def swap_weights(self, handle: H_contra, in_flight: InFlight = "abort", asleep: bool = False) -> SwapReport:
        """The engine's whole swap of the update behind ``handle``; it generates again after."""
        ...

    async def get_version(self) -> int: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def reset_prefix_cache(self) -> None: ...

    async def resume(self) -> None: ...


class WeightSource(Protocol):
    """Where a push takes its update from (the trainer's handle; a test's stand-in,
    sync or async). It may also have ``weights_refused()`` (a receiver refused a
    delta: the next update is full) and ``revert_update()`` (the update back to
    the previous version), which the sequence calls where they exist."""

    def weight_update(self) -> Awaitable[WeightUpdate | None] | WeightUpdate | None: ...


class RolloutHandle(Protocol):
    """A rollout actor: generates, scores and queues samples with one engine, and
    exposes that engine's surface to the weight-sync sequence."""

    @property
    def name(self) -> str:
        """The actor's name (the handle's, for logs: ``rollout-0``)."""
        ...

    async def generate_group(self, group: GroupRequest) -> GroupReport:
        """``group.n`` samples of one prompt, generated, scored and queued; counts only."""
        ...

    async def evaluate(self, prompts: list[GroupRequest]) -> list[tuple[float | None, int]]:
        """One greedy response per prompt, scored: (reward or None, response tokens)."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def abort(self, request_ids: list[str] | None = None) -> int:
        """Interrupt generations (all for None); returns how many were interrupted."""
        ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def update_weights(self, handle: WeightHandle) -> int:
        """Apply the update behind ``handle`` (a published ``WeightUpdate``, or a
        ``BroadcastPush`` over a broadcast link); returns the version held."""
        ...

    async def stage_weights(self, handle: WeightHandle) -> bool: ...

    async def prepare_swap(self, in_flight: InFlight = "abort") -> int:
        """Pause, abort (``abort`` mode), ``sleep(1)``: before a push that frees the KV cache."""
        ...

    async def swap_weights(self, handle: WeightHandle, in_flight: InFlight = "abort", asleep: bool = False) -> SwapReport:
        """The engine's whole swap of the update behind ``handle``; it generates again after."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def get_version(self) -> int: ...

    async def placement(self) -> Placement: ...

    async def open_weight_link(self, kind: str) -> None: ...

    async def join_weight_group(self, init_method: str, rank: int, world_size: int, backend: str,
                                sources: int = 1) -> None: ...

    async def weight_link(self) -> tuple[str, str | None, int] | None: ...

    async def weights_digest(self) -> dict[str, str]: ...

    async def statistics(self) -> dict[str, object]: ...


class TrainerHandle(Protocol):
    """The trainer the policy and the weight link talk to."""

    async def train_step(self, request: BatchRequest) -> StepReport:
        """Take the batch ``request`` describes from the queue, one optimizer step, ack it."""
        ...

    async def get_version(self) -> int: ...

    async def placement(self) -> Placement: ...

    async def open_weight_link(self, kind: str) -> str | None:
        """Publish updates over transport ``kind``; for ``broadcast``, the rendezvous address."""
        ...

    async def join_weight_group(self, init_method: str, world_size: int, backend: str) -> None: ...

    async def weight_update(self) -> WeightUpdate | None:
        """The update to this trainer's version, published (manifest and references, never the payload)."""
        ...

    async def broadcast_pending(self) -> int: ...

    async def release_weights(self) -> None: ...

    async def weights_refused(self) -> None: ...

    async def revert_update(self) -> WeightUpdate | None: ...

    async def weights_digest(self, dtype: str) -> dict[str, str]: ...

    async def save(self, path: str) -> None: ...

    async def load(self, path: str) -> None: ...

    async def save_state(self, path: str) -> None: ...

    async def load_state(self, path: str) -> None: ...


class TrainerWorkerHandle(TrainerHandle, Protocol):
    """One of a ``TrainerGroup``'s workers: a trainer, and its own shards."""

    async def local_weights(self, dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec] | None]:
        """This worker's weights in ``dtype`` (its shards, on the host) and their shard specs."""
        ...
