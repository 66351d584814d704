"""The weight-sync sequence, driven by the policy on the global loop.

    [not colocated: versions + encode while the engines still generate,
     then publish + each engine checks the payload (stage_weights), still generating]
    pause all ─► abort in-flight (keep partials) ─► sleep(1) if colocated
        ─► [colocated: versions + encode now, with the KV cache freed]
        ─► versions check: a delta only goes to engines at its base, others refuse ─► full
        ─► push to every engine concurrently, each verifies checksums in apply_update
           (a full payload it staged: copied at once) and reports the version it
           now holds, which must be the target
        ─► an engine that refused or failed gets one full retry
        ─► still failing: engines already moved are reverted (when the source can) ─► SyncFailed
    finally: resume_engines: wake_up(kv_cache) if colocated ─► reset_prefix_cache ─► resume

Encoding before the pause is safe: only a push changes an engine's weights or
version, and the source's weights are read only until the update is encoded
(``released``). It keeps the engines generating through the trainer's encode;
colocated, the encode waits for ``sleep(1)`` so its payload never shares the
device with the KV cache.

An engine here is anything with the ``RolloutEngine`` surface (``pause``,
``resume``, ``abort``, ``sleep``, ``wake_up``, ``update_weights``,
``reset_prefix_cache``, and ``version`` or ``async get_version()``) — the
engine itself or a rollout actor's handle.

A source is a :class:`WeightUpdate` (fixed; no retry possible), a
:class:`~sync.encode.WeightSender` with ``weights=`` and ``version=``, or an
object with ``weight_update()`` and optionally ``weights_refused()``,
``observe(kind, encode_ms=, transfer_ms=, apply_ms=)`` (feeds ``auto``) and
``revert_update()`` (undo on a failed push), sync or async (the trainer actor).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from sync.apply import stageable
from sync.encode import WeightSender
from sync.errors import BaseVersionMismatch, SyncFailed, WeightSyncError
from contracts.weights import WeightUpdate
from sync.metrics import SyncMetrics, SyncResult
from sync.transport import Transport, make_transport


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


async def engine_version(engine: Any) -> int:
    """The version an engine (``.version``) or actor handle (``get_version()``) holds."""
    if hasattr(engine, "get_version"):
        return int(await _maybe_await(engine.get_version()))
    return int(engine.version)


class _Source:
    """Uniform view of the three kinds of source."""

    def __init__(self, source: Any, weights: Any, version: int | None,
                 released: asyncio.Event | None = None) -> None:
        self.source, self.weights, self.version, self.released = source, weights, version, released
        self.encode_ms = 0.0
        if isinstance(source, WeightSender) and (weights is None or version is None):
            raise ValueError("sync_weights with a WeightSender needs weights= and version=")

    @property
    def can_retry(self) -> bool:
        # once released, the source's weights may already be a later version's
        return not isinstance(self.source, WeightUpdate) and not (self.released and self.released.is_set())

    def _weights(self) -> Any:
        return self.weights() if callable(self.weights) and not isinstance(self.weights, Mapping) else self.weights

    async def update(self, full: bool = False) -> WeightUpdate:
        t0 = time.perf_counter()
        s = self.source
        if isinstance(s, WeightUpdate):
            update = s
        elif isinstance(s, WeightSender):
            if full:
                s.force_full()
            update = s.encode(self._weights(), self.version)
        else:
            if full and hasattr(s, "weights_refused"):
                await _maybe_await(s.weights_refused())
            update = await _maybe_await(s.weight_update())
        self.encode_ms += (time.perf_counter() - t0) * 1e3
        return update

    async def observe(self, kind: str, encode_ms: float, transfer_ms: float, apply_ms: float) -> None:
        # sources that keep a cost model (WeightSender, or an actor forwarding to one) learn from it
        if hasattr(self.source, "observe"):
            await _maybe_await(self.source.observe(kind, encode_ms=encode_ms, transfer_ms=transfer_ms,
                                                   apply_ms=apply_ms))

    async def revert(self) -> WeightUpdate | None:
        fn: Callable[[], Any] | None = getattr(self.source, "revert_update", None)
        return await _maybe_await(fn()) if fn is not None else None


async def sync_weights(
    engines: list[Any],
    source: Any,
    *,
    colocated: bool,
    weights: Any = None,
    version: int | None = None,
    transport: Transport | None = None,
    released: asyncio.Event | None = None,
) -> SyncResult:
    """Bring every engine to the source's next version, safely.

    ``released`` is set as soon as the update is encoded: from then on the
    source's weights are not read again, so a trainer may take its next step
    while the push runs. A failed push is then not retried with a fresh full
    encode (it would read the newer weights); engines are reverted instead.

    Returns a :class:`SyncResult` with what each engine's ``abort`` returned
    (an engine: the partial outputs; a rollout actor keeps those and returns
    their count) and the :class:`SyncMetrics`. On failure raises
    :class:`~sync.errors.SyncFailed` naming the engine; engines are resumed
    either way and none is left on a different version from the others when
    the source can revert (a ``WeightSender``), else ``versions`` says where each is.
    """
    transport = transport or make_transport("inproc")
    src = _Source(source, weights, version, released)
    t0 = time.perf_counter()
    staged: _Staged | None = None
    if not colocated:
        before, update = await _prepare(engines, src)
        staged = await _stage(engines, update, transport)
    t_pause = time.perf_counter()
    try:
        await asyncio.gather(*(e.pause() for e in engines))
    except BaseException:
        if staged is not None:
            transport.release(staged.handle)
        raise
    try:
        aborted = list(await asyncio.gather(*(e.abort(None) for e in engines)))
        t_stopped = time.perf_counter()
        if colocated:
            await asyncio.gather(*(e.sleep(1) for e in engines))
            before, update = await _prepare(engines, src)
        target = update.manifest.version
        metrics = SyncMetrics(version=target, kind=update.manifest.kind, bytes_sent=0,
                              changed_fraction=update.manifest.changed_fraction, encode_ms=0.0,
                              transfer_ms=0.0, apply_ms=0.0, num_engines=len(engines),
                              num_aborted=sum(a if isinstance(a, int) else len(a) for a in aborted),
                              pause_ms=(t_stopped - t_pause) * 1e3)
        if staged is not None:
            metrics.transfer_ms, metrics.stage_ms = staged.send_ms, staged.stage_ms
        errors = await _push(engines, list(range(len(engines))), update, transport, metrics,
                             handle=None if staged is None else staged.handle)
        if errors and src.can_retry:
            metrics.num_full_retries = 1
            full = await src.update(full=True)
            errors = await _push(engines, sorted(errors), full, transport, metrics)
        if errors:
            await _revert(engines, before, src, transport)
            i, err = min(errors.items())
            versions = list(await asyncio.gather(*(engine_version(e) for e in engines)))
            raise SyncFailed(f"weight push to version {target} failed: {err!r}", i, versions) from err
        metrics.encode_ms = src.encode_ms
        metrics.sender_encode_ms = update.manifest.encode_ms
        metrics.device_plan = bool(update.manifest.layout)
    finally:
        await resume_engines(engines, colocated=colocated)
    metrics.paused_ms = (time.perf_counter() - t_pause) * 1e3
    await src.observe(metrics.kind, metrics.encode_ms, metrics.transfer_ms, metrics.apply_ms)
    metrics.total_ms = (time.perf_counter() - t0) * 1e3
    return SyncResult(version=target, metrics=metrics, aborted=aborted)


async def resume_engines(engines: list[Any], *, colocated: bool) -> None:
    """The end of every push, whatever became of it: engines run again, and
    never on caches of other weights. ``wake_up(kv_cache)`` when ``colocated``
    (the push freed it), ``reset_prefix_cache``, ``resume``; each step on every
    engine at once."""
    if colocated:
        await asyncio.gather(*(e.wake_up(["kv_cache"]) for e in engines))
    await asyncio.gather(*(e.reset_prefix_cache() for e in engines))
    await asyncio.gather(*(e.resume() for e in engines))


async def _prepare(engines: list[Any], src: _Source) -> tuple[list[int], WeightUpdate]:
    """The engines' versions and the update for them: a delta only when every
    engine holds its base (when the source can re-encode), else full for all."""
    before = list(await asyncio.gather(*(engine_version(e) for e in engines)))
    update = await src.update()
    if update.manifest.kind == "delta" and any(v != update.manifest.base_version for v in before) and src.can_retry:
        update = await src.update(full=True)  # someone missed the base: everyone gets full
    if src.released is not None:
        src.released.set()
    return before, update


class _Staged(msgspec.Struct):
    handle: Any
    send_ms: float
    stage_ms: float


async def _stage(engines: list[Any], update: WeightUpdate, transport: Transport) -> _Staged | None:
    """Publish ``update`` and let every engine that can check it now, while it
    still generates (``stage_weights``), so that the apply with the engines
    paused only copies. Best effort: a check that fails here is made again by
    the apply, which reports it. None when the transport cannot publish ahead
    (a broadcast needs every engine in step), an engine cannot check ahead, or
    the update is not one a check ahead takes (a planned full update)."""
    if (not stageable(update.manifest) or not getattr(transport, "can_stage", False)
            or not all(hasattr(e, "stage_weights") for e in engines)):
        return None
    t0 = time.perf_counter()
    handle = transport.send(update)
    t1 = time.perf_counter()
    results = await asyncio.gather(*(e.stage_weights(handle) for e in engines), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            transport.release(handle)
            raise r  # cancellation and the like
    return _Staged(handle, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)


async def _push(engines: list[Any], which: list[int], update: WeightUpdate, transport: Transport,
                metrics: SyncMetrics, handle: Any = None) -> dict[int, BaseException]:
    """Push ``update`` to ``engines[i]`` for i in ``which`` (through ``handle``
    when :func:`_stage` published it already); return the failures."""
    t0 = time.perf_counter()
    if handle is None:
        handle = transport.send(update)
    t1 = time.perf_counter()
    results = await asyncio.gather(*(engines[i].update_weights(handle) for i in which), return_exceptions=True)
    t2 = time.perf_counter()
    transport.release(handle)
    metrics.kind = update.manifest.kind
    metrics.bytes_sent += update.nbytes
    metrics.changed_fraction = update.manifest.changed_fraction
    metrics.transfer_ms += (t1 - t0) * 1e3
    metrics.apply_ms += (t2 - t1) * 1e3
    errors: dict[int, BaseException] = {}
    for i, r in zip(which, results):
        if isinstance(r, BaseException):
            if not isinstance(r, Exception):
                raise r  # cancellation and the like are not push failures
            errors[i] = r
        elif r != update.manifest.version:
            errors[i] = WeightSyncError(f"engine returned version {r}, expected {update.manifest.version}")
    return errors


async def _revert(engines: list[Any], before: list[int], src: _Source, transport: Transport) -> None:
    """Put engines that already moved back on their previous version."""
    moved = [i for i, e in enumerate(engines) if await engine_version(e) != before[i]]
    if not moved:
        return
    undo = await src.revert()
    if undo is None:
        return  # cannot: SyncFailed.versions will show the split
    await _push(engines, moved, undo, transport, SyncMetrics(version=undo.manifest.version, kind=undo.manifest.kind,
                                                            bytes_sent=0, changed_fraction=0.0, encode_ms=0.0,
                                                            transfer_ms=0.0, apply_ms=0.0))


__all__ = ["BaseVersionMismatch", "engine_version", "resume_engines", "sync_weights"]
