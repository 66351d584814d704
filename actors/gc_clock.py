"""The garbage collector's pauses in this process, on a clock.

A collection holds the GIL from start to end: every thread of the process stands still
meanwhile, the engine's decode thread too. ``install()`` (idempotent; every actor process
calls it) adds a ``gc.callbacks`` hook that sums each collection's wall time by
generation; ``snapshot()`` reads the totals (the rollout actor installs it at setup and its
``statistics()`` carries them). ``freeze()``, called once an actor process's setup is done,
keeps the full collections short.
"""

from __future__ import annotations

import gc
import os
import time

__all__ = ["freeze", "install", "snapshot"]

_totals = {"gc_pause_s": 0.0, "gc_pause_max_s": 0.0, "gc_collections": 0, "gc_full_collections": 0,
           "gc_full_pause_s": 0.0}
_started: list[float] = []  # the collection in progress's start (collections do not nest)


def _hook(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
        return
    if not _started:
        return
    dt = time.perf_counter() - _started.pop()
    _totals["gc_pause_s"] += dt
    _totals["gc_pause_max_s"] = max(_totals["gc_pause_max_s"], dt)
    _totals["gc_collections"] += 1
    if info.get("generation") == 2:
        _totals["gc_full_collections"] += 1
        _totals["gc_full_pause_s"] += dt


def install() -> None:
    if _hook not in gc.callbacks:
        gc.callbacks.append(_hook)


def freeze() -> None:
    """After an actor's setup: collect, then move every object alive into the permanent
    generation, so that later full collections walk only what the run allocates (imports,
    the model and its tensors' Python objects are never garbage, yet each full collection
    walked them all). The process must be the actor's own."""
    if os.environ.get("ASYNCRL_GC_FREEZE", "1") == "0":
        return
    gc.collect()
    gc.freeze()


def snapshot() -> dict[str, float]:
    """Collections since :func:`install` and the seconds they held the process."""
    return dict(_totals)
