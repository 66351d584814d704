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
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import importlib
import inspect
import itertools
import multiprocessing
import multiprocessing.util  # its exit hook joins child processes: registered before ours, it runs after
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import loop as global_loop
from actors import gc_clock
from actors.actor_host import STOP, serve_calls
from actors.mps import restore_environ
from actors.ray_address import join_ray_cluster
from transfer_queue.rpc import PendingReplies

__all__ = ["quiet_transformers", "Actor", "ActorDiedError", "Handle", "Runtime", "LocalRuntime", "ProcessRuntime",
           "RayRuntime", "make_runtime"]

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
                    num_gpus: float = 0, ray_options: dict[str, Any] | None = None, **kwargs: Any) -> Handle:
        """Create ``cls(*args, **kwargs)`` as an actor and ``await setup()`` on it.
        ``ray_options``: Ray's actor options (resources, a placement-group bundle:
        ``actors/placement.py``), used by the Ray runtime only."""

    def connect(self) -> None:
        """Join the cluster this runtime places actors on, if it has one (Ray)."""

    async def call_all(self, handles: list[Handle], method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every handle concurrently; the first error propagates."""
        return list(await asyncio.gather(*(h.call(method, *args, **kwargs) for h in handles)))

    @abc.abstractmethod
    async def stop(self, handle: Handle) -> None:
        """Close one actor this runtime spawned and forget it; for one that died,
        let go of what the driver still held for it (a pipe, a process entry)."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Close every actor this runtime spawned (and a cluster it started)."""


class LocalRuntime(Runtime):
    """Actors are objects in this process; their coroutines run on this loop."""

    type = "local"

    def __init__(self) -> None:
        self._actors: list[Actor] = []

    async def spawn(self, cls: type[Actor], *args: Any, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, ray_options: dict[str, Any] | None = None, **kwargs: Any) -> Handle:
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


class ActorDiedError(RuntimeError):
    """The actor's process ended (crashed, killed, or shut down) while a call was pending or made."""


# An actor's process runs its loop beside worker threads (the engine's step thread,
# a trainer's blocking calls) that hold the GIL for most of each step. At CPython's
# default 5 ms switch interval every hop of a call (inbox reader -> loop -> engine
# thread -> loop) can wait that long for the GIL, so a sync's pause / abort / resume
# round trips to a busy engine took several ms each. The process is the actor's own.
ACTOR_SWITCH_INTERVAL_S = 0.0005


def _actor_process_settings() -> None:
    sys.setswitchinterval(ACTOR_SWITCH_INTERVAL_S)


def _leave_signals_to_the_driver() -> None:
    """In a ``process`` actor's main thread. Ctrl-C in a terminal (and SIGTERM sent to
    the whole group: SLURM, systemd) reaches every process of the run. The driver
    handles it: it finishes its step, writes a checkpoint and closes the actors; an
    actor that died of the signal first would break that. An actor still ends with
    its driver (its pipe closes). Handlers, not SIG_IGN: processes it execs get the defaults."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore_signal)


def _ignore_signal(signum: int, frame: Any) -> None:
    pass


_MAIN_LOCK = threading.Lock()  # processes start from executor threads too: one hides __main__ at a time


@contextlib.contextmanager
def _main_kept_out() -> Iterator[None]:
    """Start a spawn child without the driver's ``__main__`` when that module says its
    children need nothing from it (``SPAWN_IMPORTS_MAIN = False``): spawn finds no main
    module to import again (``multiprocessing.spawn.get_preparation_data`` reads its
    ``__spec__`` and ``__file__``), so the child imports only what its actor needs."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "SPAWN_IMPORTS_MAIN", True):
        yield
        return
    with _MAIN_LOCK:
        spec, missing = getattr(main, "__spec__", None), object()
        file = main.__dict__.pop("__file__", missing)
        main.__spec__ = None
        try:
            yield
        finally:
            main.__spec__ = spec
            if file is not missing:
                main.__file__ = file


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in ``os.environ`` while a spawn child starts (it copies the environment then)."""
    if not extra:
        yield
        return
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            yield
        finally:
            restore_environ(saved)


def _serve(conn: Any, imports: tuple[str, ...], t_launch: float) -> None:
    """A ``process`` actor's process, launched at ``t_launch`` (``time.time()``): import
    ``imports`` (its class's module and what its setup will need), then take its actor
    from the pipe and serve it."""
    _actor_process_settings()
    _leave_signals_to_the_driver()
    for module in imports:  # a warm-up: what fails to import here fails, with its error, where it is used
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001
            pass
    boot_s = time.time() - t_launch
    try:
        job = conn.recv_bytes()
    except (EOFError, OSError):  # never used: the driver shut its runtime down, or is gone
        return
    cls, name, args, kwargs, t_start = pickle.loads(job)
    try:
        global_loop.run(serve_calls(conn, cls, name, args, kwargs, t_start, boot_s))
    finally:
        global_loop.shutdown()


_live_handles: weakref.WeakSet[_ProcessHandle] = weakref.WeakSet()
_DIED_REPORT_S = 5.0  # a broken pipe's reader thread reports its process's end within ~1 s (join)


_idle_procs: weakref.WeakSet[Any] = weakref.WeakSet()  # processes started ahead, no actor yet


def _end_idle(procs: list[Any]) -> None:
    """End processes that hold no actor (nothing to close: killed, even mid-import)."""
    for proc in procs:
        _idle_procs.discard(proc)
        proc.kill()
    for proc in procs:
        proc.join(5)


@atexit.register
def _end_children() -> None:
    """A driver that exits without shutting its runtime down still ends its actors:
    closing the pipe ends a child's loop; one that does not end in time is killed."""
    _end_idle(list(_idle_procs))
    for handle in list(_live_handles):
        handle._conn.close()
        handle._end_process(5)


class _ProcessHandle(Handle):
    """Client of an actor in a child process: calls are pickles over a pipe,
    answered in any order; a reader thread resolves the waiting futures."""

    def __init__(self, name: str, cls: type, proc: Any, conn: Any) -> None:
        self.name, self.cls, self.proc, self._conn = name, cls, proc, conn
        self._loop = asyncio.get_running_loop()
        self._pending = PendingReplies()
        self._ids = itertools.count()
        self._dead: str | None = None
        # Waiting on the process from two threads at once can lose its reaping (a
        # concurrent waitpid fails and is_alive() reads True): one thread at a time.
        self._proc_lock = threading.Lock()
        _live_handles.add(self)
        threading.Thread(target=self._read, name=f"asyncrl-{name}-replies", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, payload = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            try:
                value = pickle.loads(payload)
            except Exception as exc:  # noqa: BLE001 - e.g. a class this process cannot import
                ok, value = False, TypeError(f"actor {self.name!r}: its reply cannot be read here: {exc!r}")
            self._post(self._pending.settle, call_id, ok, value)
        with self._proc_lock:  # the pipe closes as the process exits: let it be reaped for its exit code
            self.proc.join(1)
            code = self.proc.exitcode
        self._post(self._fail_all, "its process ended" + (f" (exit code {code})" if code else ""))

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the driver's loop is closed (interpreter exit): nobody is waiting
            pass

    def _fail_all(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
        self._pending.fail_all(lambda: ActorDiedError(f"actor {self.name!r}: {why}"))  # one error each

    def _send(self, call_id: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            msg = pickle.dumps((call_id, method, args, kwargs), protocol=5)
        except Exception as exc:
            raise TypeError(f"actor {self.name!r}.{method}: arguments cannot be sent to its process: {exc!r}") from exc
        self._conn.send_bytes(msg)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._dead is not None:
            raise ActorDiedError(f"actor {self.name!r}: {self._dead}")
        call_id = next(self._ids)
        fut = self._loop.create_future()
        self._pending.add(call_id, fut)
        try:
            self._send(call_id, method, args, kwargs)
        except OSError as exc:  # the pipe broke: the process ended before its reader thread said so
            return await self._died_sending(call_id, fut, exc)
        except BaseException:
            self._pending.discard(call_id)
            raise
        return await fut

    async def _died_sending(self, call_id: int, fut: asyncio.Future, exc: OSError) -> Any:
        """The reader thread fails every pending call (``fut`` too) with an
        :class:`ActorDiedError` naming the exit code once it sees the pipe's end;
        if it does not in time, this call fails with one naming the broken pipe."""
        try:
            return await asyncio.wait_for(asyncio.shield(fut), _DIED_REPORT_S)
        except asyncio.TimeoutError:
            self._pending.discard(call_id)
            raise ActorDiedError(f"actor {self.name!r}: its pipe is broken ({exc})") from exc

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Close the actor, end its process (killed if it does not end in time)."""
        if self._dead is None:
            try:
                await asyncio.wait_for(self.call("close"), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - a dead or stuck actor is ended below anyway
                pass
            try:
                self._send(-1, STOP, (), {})
            except (OSError, ValueError):
                pass
        await asyncio.get_running_loop().run_in_executor(None, self._end_process, timeout_s)
        self._conn.close()
        _live_handles.discard(self)

    def _end_process(self, timeout_s: float) -> None:
        """Wait for the process to end; kill it if it does not in time."""
        with self._proc_lock:
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout_s)


class ProcessRuntime(Runtime):
    """Each actor in its own child process (no cluster; see the module docstring)."""

    type = "process"

    def __init__(self) -> None:
        self._handles: list[_ProcessHandle] = []
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: dict[type, list[tuple[Any, Any]]] = {}  # started ahead (prestart): class -> (process, pipe)
        self.env: dict[type, dict[str, str]] = {}  # what each class's processes add to the environment

    def prestart(self, counts: dict[type, int]) -> None:
        """Start the processes of actors to come now (``counts``: how many of each
        class): they import while the driver goes on, and :meth:`spawn` hands each
        its actor. Imports are most of a process's start (seconds, for torch and
        transformers), so the actors' starts overlap instead of following the queue's."""
        for cls, n in counts.items():
            self._idle.setdefault(cls, []).extend(self._start(cls, f"{cls.__name__}-{i}") for i in range(n))

    def _start(self, cls: type, name: str) -> tuple[Any, Any]:
        parent, child = self._ctx.Pipe(duplex=True)
        imports = (cls.__module__, *getattr(cls, "preload", ()))
        # not daemonic: an actor may start processes of its own (compile workers, a gloo group)
        proc = self._ctx.Process(target=_serve, args=(child, imports, time.time()), name=f"asyncrl-{name}")
        with _main_kept_out(), _environ(self.env.get(cls, {})):
            proc.start()
        child.close()
        _idle_procs.add(proc)
        return proc, parent

    async def spawn(self, cls: type[Actor], *args: Any, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, ray_options: dict[str, Any] | None = None, **kwargs: Any) -> Handle:
        t_start = time.time()
        idle = self._idle.get(cls)
        if idle:
            proc, parent = idle.pop(0)
        else:
            proc, parent = await asyncio.get_running_loop().run_in_executor(None, self._start, cls, name)
        _idle_procs.discard(proc)
        parent.send_bytes(pickle.dumps((cls, name, args, kwargs, t_start), protocol=5))
        handle = _ProcessHandle(name, cls, proc, parent)
        self._handles.append(handle)
        try:
            await handle.call("setup")
        except BaseException:
            self._handles.remove(handle)
            await handle.stop()
            raise
        return handle

    async def stop(self, handle: Handle) -> None:
        if handle in self._handles:
            self._handles.remove(handle)  # type: ignore[arg-type]
            await handle.stop()  # type: ignore[attr-defined]

    async def shutdown(self) -> None:
        handles, self._handles = self._handles, []
        await asyncio.gather(*(h.stop() for h in reversed(handles)), return_exceptions=True)
        idle = [proc for proc, _ in itertools.chain(*self._idle.values())]
        self._idle.clear()
        await asyncio.get_running_loop().run_in_executor(None, _end_idle, idle)


def _adopting(cls: type[Actor]) -> type[Actor]:
    """Subclass whose setup adopts Ray's actor loop as this process's loop.

    That loop is a uvloop loop: Ray builds an async actor's loop with uvloop when it
    is installed (``loop`` module docstring), so the actor's calls run on it directly.
    """

    class _RayActor(cls):  # type: ignore[misc, valid-type]
        async def setup(self) -> None:
            global_loop.adopt()  # Ray's (uvloop) loop, which runs every call of this actor
            _actor_process_settings()
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
        self._actors: list[Any] = []
        self.placer: Any = None  # the run's placement groups (actors/placement.py), removed at shutdown

    def _ensure_ray(self) -> Any:
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

    async def spawn(self, cls: type[Actor], *args: Any, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, ray_options: dict[str, Any] | None = None, **kwargs: Any) -> Handle:
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
