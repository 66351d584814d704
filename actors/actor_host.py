"""The actor's end of the ``process`` runtime (``actors/runtime/process.py``): in the
actor's own child process, :func:`serve_calls` builds the actor and answers the
calls that arrive on its pipe, each as a task on the process's one loop, so they
overlap as Ray's async actor calls do. A result goes back pickled; an exception
too, with a note naming the actor, its process and the traceback there (as a
``RuntimeError`` with its text when it would not survive the trip)."""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time
import traceback
from typing import TYPE_CHECKING

from actors import gc_clock

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from actors.runtime import Actor

__all__ = ["STOP", "serve_calls"]

STOP = "__stop__"  # the method name that ends the serving loop (``ProcessRuntime`` sends it last)


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


async def _answer(conn: Connection, actor: Actor, name: str, call_id: int, method: str, args: tuple, kwargs: dict) -> None:
    try:
        if isinstance(actor, BaseException):  # the constructor failed: every call gets its error
            raise actor
        value = await getattr(actor, method)(*args, **kwargs)
        if method == "setup":
            gc_clock.freeze()
        try:
            ok, payload = True, pickle.dumps(value, protocol=5)
        except Exception as exc:
            raise TypeError(f"the result of {method}() cannot be sent back: {exc!r}") from exc
    except Exception as exc:
        exc.add_note(f"(raised in actor {name!r}, process {os.getpid()}:\n{traceback.format_exc().rstrip()})")
        ok, payload = False, _error_payload(exc)
    conn.send_bytes(pickle.dumps((call_id, ok, payload), protocol=5))


async def serve_calls(conn: Connection, cls: type[Actor], name: str, args: tuple, kwargs: dict,
                      t_start: float | None = None, boot_s: float | None = None) -> None:
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
        actor: Actor = cls(*args, **kwargs)
        if t_start is not None:  # the process started and imported what its actor needs
            actor.startup_parts = {"process_s": time.time() - t_start}
            if boot_s is not None:
                actor.startup_parts["boot_s"] = boot_s
    except Exception as exc:  # noqa: BLE001 - reported to the first call (setup)
        actor = exc
    tasks: set[asyncio.Task] = set()
    while (msg := await inbox.get()) is not None:
        call_id, method, call_args, call_kwargs = pickle.loads(msg)
        if method == STOP:
            break
        task = ev.create_task(_answer(conn, actor, name, call_id, method, call_args, call_kwargs))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
