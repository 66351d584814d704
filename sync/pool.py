"""The CPU worker threads of weight sync: one process-wide pool.

The C kernels (:mod:`sync.native`) and numpy drop the GIL while they work, so a
piece split into parts, or the independent pieces of an update, run at once
here. ``NUM_THREADS``: the cores this process may use, at most 2 by default
(the work is bound by memory bandwidth); ``ASYNCRL_SYNC_THREADS`` sets it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")

NUM_THREADS = max(1, int(os.environ.get("ASYNCRL_SYNC_THREADS", "0")) or min(2, len(os.sched_getaffinity(0))))
MIN_PART = 1 << 16  # elements: smaller pieces are not split, smaller thunks share a task

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=NUM_THREADS, thread_name_prefix="sync-native")
    return _pool


def run(fns: list) -> list:
    """Call each thunk, on the pool when there is more than one (this thread works too)."""
    if len(fns) <= 1:
        return [f() for f in fns]
    futures = [_shared_pool().submit(f) for f in fns[1:]]
    first = fns[0]()
    return [first] + [f.result() for f in futures]


def _call(f: Callable[[], R]) -> R | Exception:
    try:
        return f()
    except Exception as exc:  # noqa: BLE001 - handed back to the caller
        return exc


def _call_each(group: list[Callable[[], R]]) -> list[R | Exception]:
    return [_call(f) for f in group]


def run_each(fns: list[Callable[[], R]], sizes: list[int] | None = None) -> list[R | Exception]:
    """Call every thunk on the pool (this thread waits) and return, in order,
    each one's result or the exception it raised: independent pieces run at
    once, and one bad piece does not hide what the others did. ``sizes``
    (elements per thunk) groups consecutive small thunks into tasks of at
    least ``MIN_PART`` elements: a hand-off to the pool costs more than a small
    piece's work, so a small model's update runs on this thread."""
    tasks: list[list[Callable[[], R]]]
    if sizes is None:
        tasks = [[f] for f in fns]
    else:
        tasks, work = [[]], 0
        for f, n in zip(fns, sizes, strict=True):
            if work >= MIN_PART:
                tasks.append([])
                work = 0
            tasks[-1].append(f)
            work += n
    if len(tasks) <= 1 or NUM_THREADS <= 1:
        return [_call(f) for f in fns]
    pool = _shared_pool()
    futures = [pool.submit(_call_each, group) for group in tasks]
    return [r for fut in futures for r in fut.result()]
