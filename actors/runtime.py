"""Where actors live: in this process (``local``) or as Ray actors (``ray``).

The same actor classes run under both. An actor class subclasses
:class:`Actor`: its constructor takes data only, heavy setup happens in
``async setup()``, and blocking work (a forward pass, an optimizer step) goes
through :meth:`Actor.blocking`, which runs it on the actor's one worker
thread so the event loop never stalls.

A :class:`Handle` is a thin client: ``await handle.method(*args)`` calls one
actor; :meth:`Runtime.call_all` calls a list of them. Under ``local`` the
call is a coroutine on the driver's loop; under ``ray`` it is a Ray actor
call awaited on the driver's loop.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
import inspect
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import loop as global_loop

__all__ = ["quiet_transformers", "Actor", "Handle", "Runtime", "LocalRuntime", "RayRuntime", "make_runtime"]

T = TypeVar("T")


def quiet_transformers() -> None:
    """No per-load progress bars from transformers in actor logs (the run has its own)."""
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


class Actor:
    """Base of every actor: one worker thread for blocking work."""

    _executor: concurrent.futures.ThreadPoolExecutor | None = None

    async def blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
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


class _LocalHandle(Handle):
    def __init__(self, name: str, actor: Actor) -> None:
        self.name, self.actor, self.cls = name, actor, type(actor)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.actor, method)
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{type(self.actor).__name__}.{method} must be async")
        return await fn(*args, **kwargs)


class _RayHandle(Handle):
    def __init__(self, name: str, actor: Any, cls: type) -> None:
        self.name, self.actor, self.cls = name, actor, cls

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.actor, method).remote(*args, **kwargs)


class Runtime(abc.ABC):
    """Places actors. ``spawn`` constructs and sets an actor up."""

    type: str

    @abc.abstractmethod
    async def spawn(self, cls: type[Actor], *args: Any, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, **kwargs: Any) -> Handle:
        """Create ``cls(*args, **kwargs)`` as an actor and ``await setup()`` on it."""

    async def call_all(self, handles: list[Handle], method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every handle concurrently; the first error propagates."""
        return list(await asyncio.gather(*(h.call(method, *args, **kwargs) for h in handles)))

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Close every actor this runtime spawned (and a cluster it started)."""


class LocalRuntime(Runtime):
    """Actors are objects in this process; their coroutines run on this loop."""

    type = "local"

    def __init__(self) -> None:
        self._actors: list[Actor] = []

    async def spawn(self, cls: type[Actor], *args: Any, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, **kwargs: Any) -> Handle:
        actor = cls(*args, **kwargs)
        self._actors.append(actor)
        await actor.setup()
        return _LocalHandle(name, actor)

    async def shutdown(self) -> None:
        actors, self._actors = self._actors, []
        await asyncio.gather(*(a.close() for a in reversed(actors)), return_exceptions=True)


def _adopting(cls: type[Actor]) -> type[Actor]:
    """Subclass whose setup adopts Ray's actor loop as this process's loop."""

    class _RayActor(cls):  # type: ignore[misc, valid-type]
        async def setup(self) -> None:
            global_loop.adopt()
            await super().setup()

    _RayActor.__name__ = _RayActor.__qualname__ = cls.__name__
    return _RayActor


class RayRuntime(Runtime):
    """Actors are Ray actors. ``address='auto'`` joins a running cluster,
    which is then never shut down by us; otherwise a local one is started."""

    type = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        self.address, self.num_cpus = address, num_cpus
        self._started_cluster = False
        self._actors: list[Any] = []

    def _ensure_ray(self) -> Any:
        import ray

        if not ray.is_initialized():
            if self.address is not None:
                ray.init(address=self.address, log_to_driver=False)
            else:
                ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False)
                self._started_cluster = True
        return ray

    async def spawn(self, cls: type[Actor], *args: Any, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, **kwargs: Any) -> Handle:
        ray = self._ensure_ray()
        remote_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1000)(
            _adopting(cls)
        )
        actor = remote_cls.remote(*args, **kwargs)
        self._actors.append(actor)
        await actor.setup.remote()
        return _RayHandle(name, actor, cls)

    async def shutdown(self) -> None:
        import ray

        actors, self._actors = self._actors, []
        if not ray.is_initialized():
            return
        for actor in actors:
            try:
                await asyncio.wait_for(actor.close.remote(), timeout=10)
            except Exception:  # an actor that died is already closed
                pass
            ray.kill(actor)
        if self._started_cluster:
            ray.shutdown()
            self._started_cluster = False


def make_runtime(type: str, *, address: str | None = None, num_cpus: int | None = None) -> Runtime:
    """The runtime named by ``runtime.type`` in the config."""
    if type == "local":
        return LocalRuntime()
    if type == "ray":
        return RayRuntime(address=address, num_cpus=num_cpus)
    raise ValueError(f"runtime.type: unknown runtime {type!r} (expected local or ray)")
