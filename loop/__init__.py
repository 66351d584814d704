"""The one event loop of this process.

Every coroutine of asyncrl in a process runs on one loop, created once
(uvloop when installed). Synchronous callers use :func:`run`; threads and
notebooks use :func:`submit`. No call ever creates a loop or a thread of its
own: the loop is made on first use, and at most one background thread is
started, the first time :func:`run` is called from a thread that already
runs another loop (Jupyter) or from a thread other than the loop's.

    run(coro)      block until coro is done; returns its result (on_interrupt=: an
                   interrupt asks coro to stop and waits for it, never abandons it)
    submit(coro)   schedule coro, return a concurrent.futures.Future
    get_loop()     the loop (created on first use, never replaced until shutdown)
    shutdown()     close it: cancel what is left, join the thread; idempotent

Inside a Ray async actor the running loop belongs to Ray; :func:`adopt`
makes it this process's loop so the same code runs there unchanged. Ray
makes that loop with uvloop too: ``CoreWorker.initialize_eventloops_for_actor_concurrency_group``
(``ray/_raylet.pyx``) builds each actor loop with ``ray._private.async_compat.get_new_event_loop()``,
which returns ``uvloop.new_event_loop()`` when uvloop imports and ``RAY_USE_UVLOOP``
is not off in the worker's environment (on by default, Ray >= 2.8). So every
process of a run, Ray actors included, runs one uvloop loop, whether asyncrl
started Ray or joined a cluster, and with no per-actor ``runtime_env`` (which
would cost each actor a fresh worker process, about a second, and replace a job's
own ``worker_process_setup_hook``). A loop of our own in a thread beside Ray's
would add a thread hop to every call. :func:`adopt` logs a warning when the loop
it adopts is not uvloop although uvloop is installed.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import importlib.util
import logging
import signal
import threading
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, TypeVar

__all__ = ["adopt", "get_loop", "run", "submit", "shutdown", "is_uvloop", "in_loop", "loop_name"]

T = TypeVar("T")

_lock = threading.RLock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None  # set when the loop runs in the background
_adopted = False
_SHUTDOWN_TIMEOUT_S = 10.0

log = logging.getLogger(__name__)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # uvloop is optional on platforms without wheels
        return asyncio.new_event_loop()


def get_loop() -> asyncio.AbstractEventLoop:
    """Return this process's loop, creating it on first use."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = _new_loop()
        return _loop


def adopt(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.AbstractEventLoop:
    """Make an already running loop (Ray's, in an async actor) this process's loop.

    The loop is adopted whatever its class: Ray runs the actor's methods on it, so a
    loop of our own would mean a thread hop per call. Ray makes it with uvloop (see
    the module docstring); if it did not, a warning says why.
    """
    global _loop, _adopted
    loop = loop or asyncio.get_running_loop()
    with _lock:
        if _loop is not None and _loop is not loop and not _loop.is_closed():
            if _loop.is_running():
                raise RuntimeError("this process already runs another asyncrl loop")
            _loop.close()
        first = not (_adopted and _loop is loop)
        _loop, _adopted = loop, True
    if first and not _is_uvloop(loop) and importlib.util.find_spec("uvloop") is not None:
        log.warning(
            "asyncrl: this process runs on %s, not uvloop, although uvloop is installed; in a Ray "
            "actor that means RAY_USE_UVLOOP is off in the worker's environment (unset it, or set it "
            "to 1, e.g. with ray.init(runtime_env={'env_vars': {'RAY_USE_UVLOOP': '1'}}))",
            loop_name(loop),
        )
    return loop


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """``module.class`` of ``loop`` (default: the running one), e.g. ``uvloop.Loop``."""
    cls = type(loop or asyncio.get_running_loop())
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_uvloop(loop: asyncio.AbstractEventLoop) -> bool:
    return type(loop).__module__.startswith("uvloop")


def is_uvloop() -> bool:
    """True when this process's loop is a uvloop loop."""
    return _is_uvloop(get_loop())


def in_loop() -> bool:
    """True when called from a coroutine or callback running on the global loop."""
    try:
        return asyncio.get_running_loop() is _loop
    except RuntimeError:
        return False


def _ensure_background() -> asyncio.AbstractEventLoop:
    """Start the global loop on its one background thread (once)."""
    global _thread
    loop = get_loop()
    with _lock:
        if _thread is None and not loop.is_running():
            ready = threading.Event()

            def _main() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            _thread = threading.Thread(target=_main, name="asyncrl-loop", daemon=True)
            _thread.start()
            ready.wait()
    return loop


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the global loop from any thread; never blocks."""
    loop = get_loop()
    if not loop.is_running():
        loop = _ensure_background()
    return asyncio.run_coroutine_threadsafe(coro, loop)


def run(coro: Coroutine[Any, Any, T], *, on_interrupt: Callable[[], object] | None = None) -> T:
    """Run ``coro`` to completion on the global loop and return its result.

    From a plain thread with no loop of its own the global loop runs right
    here. From a thread that runs another loop (a notebook) or while the
    global loop runs elsewhere, the coroutine goes to the loop's background
    thread and this call blocks until it is done.

    ``on_interrupt``: a KeyboardInterrupt while ``coro`` runs (Ctrl-C, a
    notebook's stop button) does not abandon ``coro`` half way on the loop:
    ``on_interrupt()`` is called there once (it should make ``coro`` end soon),
    this call waits on until ``coro`` has ended, then raises KeyboardInterrupt
    (or the error ``coro`` ended with). When the loop runs in this thread only
    SIGINT is caught so, and only in the main thread while Python's default
    handler is installed (a handler of the caller's own is left alone).
    Without ``on_interrupt`` a KeyboardInterrupt leaves ``coro`` running.
    """
    if in_loop():
        coro.close()
        raise RuntimeError("loop.run() called from the loop itself; use `await` there")
    loop = get_loop()
    try:
        asyncio.get_running_loop()
        foreign_loop = True
    except RuntimeError:
        foreign_loop = False
    if foreign_loop or loop.is_running() or _thread is not None:
        future = submit(coro)
        if on_interrupt is None:
            return future.result()
        return _wait_through_interrupts(future, loop, on_interrupt)
    if on_interrupt is None or not _default_sigint_here():
        return loop.run_until_complete(coro)
    interrupted = False

    def _on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            loop.call_soon_threadsafe(on_interrupt)

    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        result = loop.run_until_complete(coro)
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt
    return result


def _default_sigint_here() -> bool:
    """Whether SIGINT would raise KeyboardInterrupt in this thread (Python's default handler)."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


def _wait_through_interrupts(future: concurrent.futures.Future[T], loop: asyncio.AbstractEventLoop,
                             on_interrupt: Callable[[], object]) -> T:
    """``future.result()``; a KeyboardInterrupt meanwhile calls ``on_interrupt`` on
    ``loop`` (the first one only) and the wait goes on; raised once it is done."""
    interrupted = False
    while True:
        try:
            result = future.result()
            break
        except KeyboardInterrupt:
            if not interrupted:
                interrupted = True
                loop.call_soon_threadsafe(on_interrupt)
    if interrupted:
        raise KeyboardInterrupt
    return result


def shutdown() -> None:
    """Cancel what is left on the loop, stop its thread and close it. Idempotent."""
    global _loop, _thread, _adopted
    with _lock:
        loop, thread, adopted = _loop, _thread, _adopted
        _loop, _thread, _adopted = None, None, False
    if loop is None or loop.is_closed() or adopted:
        return

    async def _cancel_rest() -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_SHUTDOWN_TIMEOUT_S)
        await loop.shutdown_asyncgens()

    if thread is not None:
        try:
            asyncio.run_coroutine_threadsafe(_cancel_rest(), loop).result(_SHUTDOWN_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_SHUTDOWN_TIMEOUT_S)
    elif not loop.is_running():
        loop.run_until_complete(_cancel_rest())
    else:  # shutdown() from a callback on the loop itself: stop after this turn
        loop.call_soon(loop.stop)
        return
    loop.close()


atexit.register(shutdown)
