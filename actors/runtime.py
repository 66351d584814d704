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
guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import concurrent.futures
import functools
import inspect
import itertools
import multiprocessing
import multiprocessing.util  # its exit hook joins child processes: registered before ours, it runs after
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import loop as global_loop

__all__ = ["quiet_transformers", "Actor", "ActorDiedError", "Handle", "Runtime", "LocalRuntime", "ProcessRuntime",
           "RayRuntime", "make_runtime"]

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
                    num_gpus: float = 0, **kwargs: Any) -> Handle:
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


_STOP = "__stop__"


def _error_payload(exc: BaseException) -> bytes:
    """``exc`` pickled, or a RuntimeError with its text when it would not
    survive the trip (unpicklable, or a constructor pickle cannot call)."""
    try:
        data = pickle.dumps(exc, protocol=5)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001
        err = RuntimeError(f"{type(exc).__name__}: {exc}")
        err.__notes__ = list(getattr(exc, "__notes__", []))
        return pickle.dumps(err, protocol=5)


async def _answer(conn: Any, actor: Any, name: str, call_id: int, method: str, args: tuple, kwargs: dict) -> None:
    try:
        if isinstance(actor, BaseException):  # the constructor failed: every call gets its error
            raise actor
        value = await getattr(actor, method)(*args, **kwargs)
        try:
            ok, payload = True, pickle.dumps(value, protocol=5)
        except Exception as exc:
            raise TypeError(f"the result of {method}() cannot be sent back: {exc!r}") from exc
    except Exception as exc:
        exc.add_note(f"(raised in actor {name!r}, process {os.getpid()}:\n{traceback.format_exc().rstrip()})")
        ok, payload = False, _error_payload(exc)
    conn.send_bytes(pickle.dumps((call_id, ok, payload), protocol=5))


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


async def _serve_async(conn: Any, cls: type[Actor], name: str, args: tuple, kwargs: dict) -> None:
    """The child's main coroutine: build the actor, answer calls (each a task,
    so they overlap like Ray's async actor calls) until told to stop or orphaned."""
    ev = asyncio.get_running_loop()
    inbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    def read() -> None:  # a blocking reader thread feeds the loop
        while True:
            try:
                msg: bytes | None = conn.recv_bytes()
            except (EOFError, OSError):  # the driver is gone: end this process
                msg = None
            ev.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg is None:
                return

    threading.Thread(target=read, name="asyncrl-actor-inbox", daemon=True).start()
    try:
        actor: Any = cls(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to the first call (setup)
        actor = exc
    tasks: set[asyncio.Task] = set()
    while (msg := await inbox.get()) is not None:
        call_id, method, call_args, call_kwargs = pickle.loads(msg)
        if method == _STOP:
            break
        task = ev.create_task(_answer(conn, actor, name, call_id, method, call_args, call_kwargs))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _serve(conn: Any, cls: type[Actor], name: str, args: tuple, kwargs: dict) -> None:
    _actor_process_settings()
    _leave_signals_to_the_driver()
    try:
        global_loop.run(_serve_async(conn, cls, name, args, kwargs))
    finally:
        global_loop.shutdown()


_live_handles: weakref.WeakSet[_ProcessHandle] = weakref.WeakSet()
_DIED_REPORT_S = 5.0  # a broken pipe's reader thread reports its process's end within ~1 s (join)


@atexit.register
def _end_children() -> None:
    """A driver that exits without shutting its runtime down still ends its actors:
    closing the pipe ends a child's loop; one that does not end in time is killed."""
    for handle in list(_live_handles):
        handle._conn.close()
        handle._end_process(5)


class _ProcessHandle(Handle):
    """Client of an actor in a child process: calls are pickles over a pipe,
    answered in any order; a reader thread resolves the waiting futures."""

    def __init__(self, name: str, cls: type, proc: Any, conn: Any) -> None:
        self.name, self.cls, self.proc, self._conn = name, cls, proc, conn
        self._loop = asyncio.get_running_loop()
        self._pending: dict[int, asyncio.Future] = {}
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
            self._post(self._settle, call_id, ok, value)
        with self._proc_lock:  # the pipe closes as the process exits: let it be reaped for its exit code
            self.proc.join(1)
            code = self.proc.exitcode
        self._post(self._fail_all, "its process ended" + (f" (exit code {code})" if code else ""))

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the driver's loop is closed (interpreter exit): nobody is waiting
            pass

    def _settle(self, call_id: int, ok: bool, value: Any) -> None:
        fut = self._pending.pop(call_id, None)
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _fail_all(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ActorDiedError(f"actor {self.name!r}: {why}"))

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
        self._pending[call_id] = fut
        try:
            self._send(call_id, method, args, kwargs)
        except OSError as exc:  # the pipe broke: the process ended before its reader thread said so
            return await self._died_sending(call_id, fut, exc)
        except BaseException:
            self._pending.pop(call_id, None)
            raise
        return await fut

    async def _died_sending(self, call_id: int, fut: asyncio.Future, exc: OSError) -> Any:
        """The reader thread fails every pending call (``fut`` too) with an
        :class:`ActorDiedError` naming the exit code once it sees the pipe's end;
        if it does not in time, this call fails with one naming the broken pipe."""
        try:
            return await asyncio.wait_for(asyncio.shield(fut), _DIED_REPORT_S)
        except asyncio.TimeoutError:
            self._pending.pop(call_id, None)
            raise ActorDiedError(f"actor {self.name!r}: its pipe is broken ({exc})") from exc

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Close the actor, end its process (killed if it does not end in time)."""
        if self._dead is None:
            try:
                await asyncio.wait_for(self.call("close"), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - a dead or stuck actor is ended below anyway
                pass
            try:
                self._send(-1, _STOP, (), {})
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

    async def spawn(self, cls: type[Actor], *args: Any, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, **kwargs: Any) -> Handle:
        parent, child = self._ctx.Pipe(duplex=True)
        # not daemonic: an actor may start processes of its own (compile workers, a gloo group)
        proc = self._ctx.Process(target=_serve, args=(child, cls, name, args, kwargs), name=f"asyncrl-{name}")
        await asyncio.get_running_loop().run_in_executor(None, proc.start)
        child.close()
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

    def _ensure_ray(self) -> Any:
        import ray

        if not ray.is_initialized():
            if self.address is not None:
                _join_ray_cluster(ray, self.address, self.connect_timeout_s)
            else:
                ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False)
                self._started_cluster = True
        return ray

    def connect(self) -> None:
        self._ensure_ray()

    async def spawn(self, cls: type[Actor], *args: Any, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, **kwargs: Any) -> Handle:
        ray = self._ensure_ray()
        # No runtime_env: Ray already makes the actor's loop with uvloop, in our cluster or one
        # we joined; a per-actor runtime_env would cost a fresh worker process (~1 s) per actor.
        remote_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1000)(
            _adopting(cls)
        )
        actor = remote_cls.remote(*args, **kwargs)
        self._actors.append(actor)
        await actor.setup.remote()
        return _RayHandle(name, actor, cls)

    async def stop(self, handle: Handle) -> None:
        import ray

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


# Joining a cluster (``runtime.address``). ``ray.init`` retries an address that
# refuses connections for minutes and waits on one that accepts but never answers
# for longer, each ending in a traceback; it cannot be cancelled once started (its
# GCS client retries in C++). So the address is checked first, from this thread,
# under ``runtime.connect_timeout_s``, leaving nothing behind when it fails (one
# socket, closed): ``auto`` resolved as Ray resolves it, a TCP connection, and the
# answer a gRPC server (Ray's GCS) gives to the HTTP/2 preface. An explicit address
# that answers is then asked for its cluster id, which says at once whether it is
# a GCS and whether this process holds the cluster's token.

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
_H2_SETTINGS = 0x04
_CHECK_PORT = ("check that the head node is up and that this is its GCS address (`ray start --head` prints it; "
               "port 6379 unless --port)")
_CHECK_TOKEN = ("the cluster uses Ray's token authentication: set RAY_AUTH_MODE=token and give this process the "
                "cluster's token (`ray get-auth-token` on the head prints it) in ~/.ray/auth_token, "
                "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")


def _join_ray_cluster(ray: Any, address: str, timeout_s: float) -> None:
    """``ray.init(address=address)`` after checking, within ``timeout_s``, that a Ray
    cluster answers there; a ``ConnectionError`` of one line naming the address and
    what to check when none does (nothing is started, nothing left running)."""
    target = _resolve_ray_address(address)
    from_env = address == "auto" and bool(os.environ.get("RAY_ADDRESS"))
    label = ("runtime.address" if address != "auto" or target is None else
             f"runtime.address=auto (RAY_ADDRESS={target})" if from_env else
             f"runtime.address=auto (found {target})")
    if target is not None:
        _probe_ray_address(target, timeout_s, label)
        # ray.init turns token auth on by itself (a token file, RAY_AUTH_MODE unset) only for an
        # 'auto' it resolves without RAY_ADDRESS: this check would not see that, ray.init reports it
        if (address != "auto" or from_env) and "://" not in target:
            _check_gcs(target, label)
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as err:  # noqa: BLE001 - whatever Ray raises, the user gets one line naming the address
        try:
            ray.shutdown()  # a half-made connection (ray.init failed midway)
        except Exception:  # noqa: BLE001
            pass
        raise ConnectionError(_join_failed(label, target or address, err)) from None


def _resolve_ray_address(address: str) -> str | None:
    """The ``host:port`` (or ``ray://host:port``) that ``ray.init(address=address)``
    would join; ``None`` when it cannot be told here (another Ray version: ray.init
    decides). ``auto`` with no cluster to join is a ``ConnectionError``: Ray would
    raise one too; with ``RAY_ADDRESS=local`` Ray would start a cluster instead."""
    if address != "auto":
        return address
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:
        return None
    env = os.environ.get("RAY_ADDRESS") or None
    if env == "local":
        raise ConnectionError("runtime.address=auto: RAY_ADDRESS=local asks Ray to start a new cluster, not to join "
                              "one; set RAY_ADDRESS to the head's host:port or unset it (or leave runtime.address "
                              "unset to start a cluster for this run)")
    try:
        return get_ray_address_from_environment("auto", None)
    except ConnectionError:
        raise ConnectionError("runtime.address=auto: no running Ray cluster found on this machine (RAY_ADDRESS is "
                              "unset and no Ray node runs here); start one with `ray start --head`, set "
                              "runtime.address to the head's host:port, or leave runtime.address unset to start "
                              "a cluster for this run") from None


def _probe_ray_address(address: str, timeout_s: float, label: str = "runtime.address") -> None:
    """``ConnectionError`` naming ``address`` unless something there accepts a TCP
    connection and answers the HTTP/2 preface as a gRPC server does (Ray's GCS, or
    the Ray Client server for ``ray://``), all within ``timeout_s``. With Ray's TLS
    on (``RAY_USE_TLS``) only the connection is checked."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return  # not host:port: ray.init says what is wrong with it
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except TimeoutError:
        raise ConnectionError(f"{label}: no Ray cluster answers at {address} (no connection within {timeout_s:g} s, "
                              f"runtime.connect_timeout_s); check the host name and that no firewall drops the port; "
                              f"{_CHECK_PORT}") from None
    except OSError as err:
        raise ConnectionError(f"{label}: no Ray cluster answers at {address} "
                              f"({err.strerror or type(err).__name__}); {_CHECK_PORT}") from None
    with sock:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(_H2_PREFACE)
            head = b""
            while len(head) < 9 and (chunk := sock.recv(9 - len(head))):
                head += chunk
        except TimeoutError:
            raise ConnectionError(f"{label}: {address} accepted a connection but did not answer within {timeout_s:g} s "
                                  f"(runtime.connect_timeout_s); {_CHECK_PORT}, and not another service's "
                                  f"or an overloaded head's") from None
        except OSError as err:
            head = f"({err.strerror or type(err).__name__})".encode()
    if len(head) < 9 or head[3] != _H2_SETTINGS:
        what = "closed the connection" if not head else f"answered {head[:9]!r}"
        raise ConnectionError(f"{label}: something listens at {address} but it is not a Ray cluster (it {what}, "
                              f"not as Ray's gRPC); {_CHECK_PORT}")


def _check_gcs(address: str, label: str) -> None:
    """Ask the GCS at ``address`` (which answered the probe) for its cluster id, as
    ``ray.init`` does first: a refused token or a gRPC server that is not a GCS is
    one line now (``ray.init`` would retry it for ~20 s and then name neither)."""
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError, RpcError
    except ImportError:
        return
    try:
        GcsClient(address=address)
    except AuthenticationError:
        raise ConnectionError(f"{label}: the Ray cluster at {address} refused this process's token (none or "
                              f"another); {_CHECK_TOKEN}") from None
    except RpcError as err:
        if "not found" in str(err).lower() or "unimplemented" in str(err).lower():
            raise ConnectionError(f"{label}: {address} answers gRPC but is not a Ray GCS (a Ray Client port? join "
                                  f"that as ray://{address}); {_CHECK_PORT}") from None
    except Exception:  # noqa: BLE001 - ray.init tries again and reports it
        pass


def _join_failed(label: str, address: str, err: BaseException) -> str:
    """One line for a ``ray.init`` that failed after the checks."""
    chain, e = [], err
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(" ".join(f"{type(e).__name__}: {e}" for e in chain).split())
    if any(type(e).__name__ == "AuthenticationError" for e in chain) or "InvalidAuthToken" in text:
        return f"{label}: the Ray cluster at {address} refused this process's token (none or another); {_CHECK_TOKEN}"
    first = " ".join(str(err).split()) or type(err).__name__
    return f"{label}: joining the Ray cluster at {address} failed ({type(err).__name__}: {first[:300]}); {_CHECK_PORT}"


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
