"""Schedules (fully-async and its baselines), admission, advantages, losses, tasks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policies.base import PolicyBase
    from policies.config import RunSettings

__all__ = ["make_policy"]


def make_policy(cfg: RunSettings, **parts: object) -> PolicyBase:
    """The schedule named by ``policy.type``."""
    kind = cfg.policy.type
    if kind == "fully_async":
        from policies.fully_async import FullyAsyncPolicy

        return FullyAsyncPolicy(cfg, **parts)
    if kind in ("sync", "one_step_off"):
        from policies.baselines import OneStepOffPolicy, SyncPolicy

        return (SyncPolicy if kind == "sync" else OneStepOffPolicy)(cfg, **parts)
    raise ValueError(f"policy.type: unknown policy {kind!r} (expected fully_async, sync, one_step_off)")
