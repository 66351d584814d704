"""The endpoints of the two kinds of actor, as the policy, the weight sync and
the composition root call them: ``await handle.method(...)``.

    RolloutHandle          a rollout actor (``actors.rollout.RolloutActor``)
    TrainerHandle          the trainer: one ``actors.trainer.TrainerActor``, or a
                           ``TrainerGroup`` of several standing in for one
    TrainerWorkerHandle    one trainer worker, as a ``TrainerGroup`` calls it

A handle (``actors.runtime.Handle``) forwards any public method of its actor
and awaits it, whatever the runtime; these Protocols name the ones that make
the seam, with their signatures. ``tests/test_trainer_workers.py`` checks the
actor classes and ``TrainerGroup`` against them, signature by signature.
"""

from __future__ import annotations

from typing import Any, Protocol

from contracts.placement import Placement
from contracts.rollout import GroupReport, GroupRequest, InFlight, SwapReport
from contracts.training import BatchRequest, StepReport
from contracts.weights import ShardSpec, WeightUpdate

__all__ = ["RolloutHandle", "TrainerHandle", "TrainerWorkerHandle"]


class RolloutHandle(Protocol):
    """A rollout actor: generates, scores and queues samples with one engine, and
    exposes that engine's surface to the weight-sync sequence."""

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

    async def update_weights(self, handle: Any) -> int:
        """Apply the update behind ``handle`` (a published ``WeightUpdate``, or
        ``sync.link.BroadcastPush`` over a broadcast link); returns the version held."""
        ...

    async def stage_weights(self, handle: Any) -> bool: ...

    async def prepare_swap(self, in_flight: InFlight = "abort") -> int:
        """Pause, abort (``abort`` mode), ``sleep(1)``: before a push that frees the KV cache."""
        ...

    async def swap_weights(self, handle: Any, in_flight: InFlight = "abort", asleep: bool = False) -> SwapReport:
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

    async def statistics(self) -> dict[str, Any]: ...


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

    async def local_weights(self, dtype: str) -> tuple[dict[str, Any], dict[str, ShardSpec] | None]:
        """This worker's weights in ``dtype`` (its shards, on the host) and their shard specs."""
        ...
