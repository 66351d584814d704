"""Schedules (fully-async and its baselines), admission, advantages, losses, tasks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contracts.handles import RolloutHandle, TrainerHandle
    from policies.base import PolicyBase
    from policies.config import RunSettings
    from policies.faults import Respawn
    from policies.task_base import Task
    from sync.link import WeightSync
    from transfer_queue import TransferQueue

__all__ = ["make_policy"]


def make_policy(cfg: RunSettings, *, rollouts: list[RolloutHandle], trainer: TrainerHandle, queue: TransferQueue,
                task: Task, weight_sync: WeightSync, respawn_rollout: Respawn | None = None) -> PolicyBase:
    """The schedule named by ``policy.type``, driving ``rollouts`` and ``trainer``
    (see :class:`policies.base.PolicyBase`)."""
    kind = cfg.policy.type
    cls: type[PolicyBase]
    if kind == "fully_async":
        from policies.fully_async import FullyAsyncPolicy

        cls = FullyAsyncPolicy
    elif kind in ("sync", "one_step_off"):
        from policies.baselines import OneStepOffPolicy, SyncPolicy

        cls = SyncPolicy if kind == "sync" else OneStepOffPolicy
    else:
        raise ValueError(f"policy.type: unknown policy {kind!r} (expected fully_async, sync, one_step_off)")
    return cls(cfg, rollouts=rollouts, trainer=trainer, queue=queue, task=task, weight_sync=weight_sync,
               respawn_rollout=respawn_rollout)
