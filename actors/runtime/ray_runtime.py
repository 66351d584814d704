"""The ``ray`` runtime: actors are Ray actors, in a cluster it starts (on
loopback) or joins (``address``: ``auto``, ``host:port``, ``ray://host:port``,
checked first by ``actors/ray_address.py``). Ray is imported only when used."""

from __future__ import annotations

import asyncio
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

import loop as global_loop
from actors import gc_clock
from actors.ray_address import join_ray_cluster
from actors.runtime.base import Actor, Handle, Runtime, actor_process_settings

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from actors.placement import Placer

__all__ = ["RayRuntime"]


class _RayHandle(Handle):
    def __init__(self, name: str, actor: ActorHandle, cls: type) -> None:
        self.name, self.actor, self.cls = name, actor, cls

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.actor, method).remote(*args, **kwargs)


def _adopting(cls: type[Actor]) -> type[Actor]:
    """Subclass whose setup adopts Ray's actor loop as this process's loop.

    That loop is a uvloop loop: Ray builds an async actor's loop with uvloop when it
    is installed (``loop`` module docstring), so the actor's calls run on it directly.
    """

    class _RayActor(cls):  # type: ignore[misc, valid-type]
        async def setup(self) -> None:
            global_loop.adopt()  # Ray's (uvloop) loop, which runs every call of this actor
            actor_process_settings()
            await super().setup()
            gc_clock.freeze()

    _RayActor.__name__ = _RayActor.__qualname__ = cls.__name__
    return _RayActor


class RayRuntime(Runtime):
    """Actors are Ray actors. An ``address`` (``auto``, ``host:port``,
    ``ray://host:port``) joins a running cluster, which is then never shut down
    by us; ``None`` starts a local one. A process already connected to Ray
    (``ray.init`` by the user) is used as it is."""

    type = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None,
                 connect_timeout_s: float = 30.0) -> None:
        self.address, self.num_cpus, self.connect_timeout_s = address, num_cpus, connect_timeout_s
        self._started_cluster = False
        self._actors: list[ActorHandle] = []
        self.placer: Placer | None = None  # the run's placement groups (actors/placement.py), removed at shutdown

    def _ensure_ray(self) -> ModuleType:
        import ray  # ~0.75 s to import: only Ray runs pay it

        if not ray.is_initialized():
            if self.address is not None:
                join_ray_cluster(ray, self.address, self.connect_timeout_s)
            else:
                # A cluster of our own listens on loopback only (docs/ray-clusters.md). Ray takes
                # 127.0.0.1 as the node IP only where it holds multi-node clusters off (its macOS
                # default; an explicit _node_ip_address="127.0.0.1" becomes the interface address):
                # the flag read at import for this process, the variable for those it starts now.
                from ray._private import ray_constants

                env, flag = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"), getattr(
                    ray_constants, "ENABLE_RAY_CLUSTER", None)  # another Ray: its own default
                os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
                if flag is not None:
                    ray_constants.ENABLE_RAY_CLUSTER = False
                try:
                    ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False)
                finally:
                    if flag is not None:
                        ray_constants.ENABLE_RAY_CLUSTER = flag
                    if env is None:
                        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
                    else:
                        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = env
                self._started_cluster = True
        return ray

    def connect(self) -> None:
        self._ensure_ray()

    async def spawn(self, cls: type[Actor], *args: object, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, ray_options: dict[str, object] | None = None, **kwargs: object) -> Handle:
        ray = self._ensure_ray()
        # No runtime_env: Ray already makes the actor's loop with uvloop, in our cluster or one
        # we joined; a per-actor runtime_env would cost a fresh worker process (~1 s) per actor.
        remote_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1000)(
            _adopting(cls)
        )
        actor = remote_cls.options(**(ray_options or {})).remote(*args, **kwargs)
        self._actors.append(actor)
        await actor.setup.remote()
        return _RayHandle(name, actor, cls)

    async def stop(self, handle: Handle) -> None:
        import ray  # ~0.75 s to import: only Ray runs pay it

        actor = handle.actor  # type: ignore[attr-defined]
        if not any(a is actor for a in self._actors):
            return
        self._actors = [a for a in self._actors if a is not actor]
        try:
            await asyncio.wait_for(actor.close.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - an actor that died is already closed
            pass
        ray.kill(actor)

    async def shutdown(self) -> None:
        import ray  # ~0.75 s to import: only Ray runs pay it

        actors, self._actors = self._actors, []
        if not ray.is_initialized():
            return
        for actor in actors:
            try:
                await asyncio.wait_for(actor.close.remote(), timeout=10)
            except Exception:  # an actor that died is already closed
                pass
            ray.kill(actor)
        if self.placer is not None:
            self.placer.release()
            self.placer = None
        if self._started_cluster:
            ray.shutdown()
            self._started_cluster = False
