"""The end of every push, on an engine's side: imported by the engines and by
the driver's sequence (``sync.sequence``) alike, so that no engine imports a
module of the driver's."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Resumable", "resume_engine"]


class Resumable(Protocol):
    """What :func:`resume_engine` calls: an engine, or a rollout actor's handle."""

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def reset_prefix_cache(self) -> None: ...

    async def resume(self) -> None: ...


async def resume_engine(engine: Resumable, *, colocated: bool) -> None:
    """The end of every push, whatever became of it, the one place it is written:
    the engine runs again, and never on caches of other weights. ``wake_up(kv_cache)``
    when ``colocated`` (the push freed it), ``reset_prefix_cache``, ``resume``. A
    swap ends this way by itself (``RolloutEngine.swap_weights``); the driver calls
    it for a push that stopped short of the swaps."""
    if colocated:
        await engine.wake_up(["kv_cache"])
    await engine.reset_prefix_cache()
    await engine.resume()
