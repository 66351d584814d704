"""Where actors live: in this process (``local``), each in a child process
of its own (``process``), or as Ray actors (``ray``).

The same actor classes run under all three. An actor class subclasses
:class:`Actor`: its constructor takes data only, heavy setup happens in
``async setup()``, and blocking work (a forward pass, an optimizer step) goes
through :meth:`Actor.blocking`, which runs it on the actor's one worker
thread so the event loop never stalls.

A :class:`Handle` is a thin client: ``await handle.method(*args)`` calls one
actor; :meth:`Runtime.call_all` calls a list of them. Under ``local`` the
call is a coroutine on the driver's loop; under ``process`` and ``ray`` it
is a message to the actor's process, awaited on the driver's loop.

``process`` needs no cluster: each actor gets a ``multiprocessing`` child
(spawn start method, so CUDA initialises cleanly there) running its own
loop, and calls travel over a pipe as pickles (arguments and results by
value). In a run they carry control only: samples go through the
TransferQueue's sockets and weights over the weight link (``sync.link``). Use it when
one process would make the actors' Python share one GIL: a trainer's step
and an engine's scheduler then run side by side instead of taking turns.
As with any spawn-based multiprocessing, a script that starts a run must
guard its entry point with ``if __name__ == "__main__":``; spawn imports it
again in every child (as ``__mp_main__``) unless it says its children need
nothing from it (``SPAWN_IMPORTS_MAIN = False``, as ``actors.launch`` does:
importing it costs torch's import, seconds, in a queue host that needs none). The actor's end of
the pipe is ``actors/actor_host.py``; ``ray`` checks the address of a cluster it
joins first (``actors/ray_address.py``).

    base.py         Actor, Handle, Runtime, ActorDiedError
    local.py        LocalRuntime
    process.py      ProcessRuntime (its children, their pipes and their ends)
    ray_runtime.py  RayRuntime
"""

from __future__ import annotations

from actors.runtime.base import (
    ACTOR_SWITCH_INTERVAL_S,
    Actor,
    ActorDiedError,
    Handle,
    Runtime,
    quiet_transformers,
)
from actors.runtime.local import LocalRuntime
from actors.runtime.process import ProcessRuntime
from actors.runtime.ray_runtime import RayRuntime

__all__ = ["ACTOR_SWITCH_INTERVAL_S", "quiet_transformers", "Actor", "ActorDiedError", "Handle", "Runtime",
           "LocalRuntime", "ProcessRuntime", "RayRuntime", "make_runtime"]


def make_runtime(type: str, *, address: str | None = None, num_cpus: int | None = None,
                 connect_timeout_s: float = 30.0) -> Runtime:
    """The runtime named by ``runtime.type`` in the config."""
    if type == "local":
        return LocalRuntime()
    if type == "process":
        return ProcessRuntime()
    if type == "ray":
        return RayRuntime(address=address, num_cpus=num_cpus, connect_timeout_s=connect_timeout_s)
    raise ValueError(f"runtime.type: unknown runtime {type!r} (expected local, process or ray)")
