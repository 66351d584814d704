"""The ``local`` runtime: actors are objects in the driver's process, their
calls coroutines on its loop (no copies, no serialization)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from actors.runtime.base import Actor, Handle, Runtime

__all__ = ["LocalRuntime"]


class _LocalHandle(Handle):
    def __init__(self, name: str, actor: Actor) -> None:
        self.name, self.actor, self.cls = name, actor, type(actor)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.actor, method)
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{type(self.actor).__name__}.{method} must be async")
        return await fn(*args, **kwargs)


class LocalRuntime(Runtime):
    """Actors are objects in this process; their coroutines run on this loop."""

    type = "local"

    def __init__(self) -> None:
        self._actors: list[Actor] = []

    async def spawn(self, cls: type[Actor], *args: object, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, ray_options: dict[str, object] | None = None, **kwargs: object) -> Handle:
        actor = cls(*args, **kwargs)
        self._actors.append(actor)
        await actor.setup()
        return _LocalHandle(name, actor)

    async def stop(self, handle: Handle) -> None:
        actor = handle.actor  # type: ignore[attr-defined]
        if any(a is actor for a in self._actors):
            self._actors = [a for a in self._actors if a is not actor]
            try:
                await actor.close()
            except Exception:  # noqa: BLE001 - a broken actor is let go all the same
                pass

    async def shutdown(self) -> None:
        actors, self._actors = self._actors, []
        await asyncio.gather(*(a.close() for a in reversed(actors)), return_exceptions=True)
