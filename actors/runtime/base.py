"""The runtime's base: :class:`Actor` (what every actor class subclasses),
:class:`Handle` (a thin client of one actor), :class:`Runtime` (what places
actors); the error a call to an actor whose process ended raises, and what an
actor's own process sets for itself."""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["ACTOR_SWITCH_INTERVAL_S", "Actor", "ActorDiedError", "Handle", "Runtime", "actor_process_settings",
           "quiet_transformers"]

T = TypeVar("T")


def quiet_transformers() -> None:
    """No per-load progress bars from transformers in actor logs (the run has its own)."""
    try:
        import transformers  # ~2 s to import: only actors that load a model pay it

        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


class Actor:
    """Base of every actor: one worker thread for blocking work."""

    _executor: concurrent.futures.ThreadPoolExecutor | None = None
    preload: tuple[str, ...] = ()  # modules a process of this actor imports before its actor arrives
    # seconds of this actor's start, by part (under ``process``, ``process_s``: from its spawn
    # until its process had started and imported its modules; ``boot_s``: from the process's
    # launch, often before the spawn (``prestart``), until then: the interpreter, spawn's own
    # imports and the modules'; the rest its ``setup`` records): the run logs them
    startup_parts: dict[str, float]

    async def blocking(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run ``fn`` on this actor's worker thread (one per actor, made once)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=type(self).__name__
            )
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args, **kwargs)
        )

    async def setup(self) -> None:
        """Heavy initialisation; its failure reaches whoever spawned the actor."""

    async def ping(self) -> int:
        return os.getpid()

    def note_startup(self, part: str, t0: float) -> None:
        """Record ``part`` of this actor's start: the seconds since ``t0`` (perf_counter)."""
        self.__dict__.setdefault("startup_parts", {})[part] = time.perf_counter() - t0

    async def startup_timings(self) -> dict[str, float]:
        """:attr:`startup_parts`: where this actor's start went, seconds by part."""
        return dict(getattr(self, "startup_parts", {}))

    async def close(self) -> None:
        """Release the worker thread; the actor is unusable afterwards."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


class Handle(abc.ABC):
    """A thin client of one actor: ``await handle.method(*args, **kwargs)``."""

    name: str
    cls: type

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        # Only the actor's public methods: ``hasattr(handle, m)`` tells the truth.
        if method.startswith("_") or not callable(getattr(self.cls, method, None)):
            raise AttributeError(f"{self.cls.__name__} has no endpoint {method!r}")
        return functools.partial(self.call, method)

    @abc.abstractmethod
    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the actor and await its result."""


class Runtime(abc.ABC):
    """Places actors. ``spawn`` constructs and sets an actor up."""

    type: str

    @abc.abstractmethod
    async def spawn(self, cls: type[Actor], *args: object, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, ray_options: dict[str, object] | None = None, **kwargs: object) -> Handle:
        """Create ``cls(*args, **kwargs)`` as an actor and ``await setup()`` on it.
        ``ray_options``: Ray's actor options (resources, a placement-group bundle:
        ``actors/placement.py``), used by the Ray runtime only."""

    def connect(self) -> None:
        """Join the cluster this runtime places actors on, if it has one (Ray)."""

    async def call_all(self, handles: list[Handle], method: str, *args: object, **kwargs: object) -> list[object]:
        """Call ``method`` on every handle concurrently; the first error propagates."""
        return list(await asyncio.gather(*(h.call(method, *args, **kwargs) for h in handles)))

    @abc.abstractmethod
    async def stop(self, handle: Handle) -> None:
        """Close one actor this runtime spawned and forget it; for one that died,
        let go of what the driver still held for it (a pipe, a process entry)."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Close every actor this runtime spawned (and a cluster it started)."""


class ActorDiedError(RuntimeError):
    """The actor's process ended (crashed, killed, or shut down) while a call was pending or made."""


# An actor's process runs its loop beside worker threads (the engine's step thread,
# a trainer's blocking calls) that hold the GIL for most of each step. At CPython's
# default 5 ms switch interval every hop of a call (inbox reader -> loop -> engine
# thread -> loop) can wait that long for the GIL, so a sync's pause / abort / resume
# round trips to a busy engine took several ms each. The process is the actor's own.
ACTOR_SWITCH_INTERVAL_S = 0.0005


def actor_process_settings() -> None:
    """What an actor's own process sets for itself (see ``ACTOR_SWITCH_INTERVAL_S``)."""
    sys.setswitchinterval(ACTOR_SWITCH_INTERVAL_S)
