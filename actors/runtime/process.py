"""The ``process`` runtime: each actor in a ``multiprocessing`` child of its own
(spawn start method), its calls pickles over a pipe (see the package docstring).

    driver:  ProcessRuntime.spawn ─► _ProcessHandle.call ─pickle─► pipe ─► actors/actor_host.py (child)
             a reader thread per actor settles the waiting futures ◄─pickle─ pipe ◄─┘

Processes can be started ahead of their actors (``prestart``): the imports,
most of a start, then overlap. A driver that exits without shutting its
runtime down still ends its children (``atexit``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
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
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import loop as global_loop
from actors.actor_host import STOP, serve_calls
from actors.mps import restore_environ
from actors.runtime.base import Actor, ActorDiedError, Handle, Runtime, actor_process_settings
from transfer_queue.rpc import PendingReplies

__all__ = ["ProcessRuntime"]


def _leave_signals_to_the_driver() -> None:
    """In a ``process`` actor's main thread. Ctrl-C in a terminal (and SIGTERM sent to
    the whole group: SLURM, systemd) reaches every process of the run. The driver
    handles it: it finishes its step, writes a checkpoint and closes the actors; an
    actor that died of the signal first would break that. An actor still ends with
    its driver (its pipe closes). Handlers, not SIG_IGN: processes it execs get the defaults."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore_signal)


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
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


def _serve(conn: Connection, imports: tuple[str, ...], t_launch: float) -> None:
    """A ``process`` actor's process, launched at ``t_launch`` (``time.time()``): import
    ``imports`` (its class's module and what its setup will need), then take its actor
    from the pipe and serve it."""
    actor_process_settings()
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


_idle_procs: weakref.WeakSet[BaseProcess] = weakref.WeakSet()  # processes started ahead, no actor yet


def _end_idle(procs: list[BaseProcess]) -> None:
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

    def __init__(self, name: str, cls: type, proc: BaseProcess, conn: Connection) -> None:
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

    def _post(self, fn: Callable[..., None], *args: object) -> None:
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

    async def _died_sending(self, call_id: int, fut: asyncio.Future, exc: OSError) -> object:
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
        # started ahead (prestart): class -> (process, pipe)
        self._idle: dict[type, list[tuple[BaseProcess, Connection]]] = {}
        self.env: dict[type, dict[str, str]] = {}  # what each class's processes add to the environment

    def prestart(self, counts: dict[type, int]) -> None:
        """Start the processes of actors to come now (``counts``: how many of each
        class): they import while the driver goes on, and :meth:`spawn` hands each
        its actor. Imports are most of a process's start (seconds, for torch and
        transformers), so the actors' starts overlap instead of following the queue's."""
        for cls, n in counts.items():
            self._idle.setdefault(cls, []).extend(self._start(cls, f"{cls.__name__}-{i}") for i in range(n))

    def _start(self, cls: type, name: str) -> tuple[BaseProcess, Connection]:
        parent, child = self._ctx.Pipe(duplex=True)
        imports = (cls.__module__, *getattr(cls, "preload", ()))
        # not daemonic: an actor may start processes of its own (compile workers, a gloo group)
        proc = self._ctx.Process(target=_serve, args=(child, imports, time.time()), name=f"asyncrl-{name}")
        with _main_kept_out(), _environ(self.env.get(cls, {})):
            proc.start()
        child.close()
        _idle_procs.add(proc)
        return proc, parent

    async def spawn(self, cls: type[Actor], *args: object, name: str, num_cpus: float = 1,
                    num_gpus: float = 0, ray_options: dict[str, object] | None = None, **kwargs: object) -> Handle:
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
