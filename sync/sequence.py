"""The weight-sync sequence, driven by the policy on the global loop. The
driver orders a push and compares versions; each engine runs its own swap.

    versions: as each engine's last swap reported them (asked only of new engines)
    ─► encode (a delta only when every engine holds its base, else full for all),
       while the engines still generate
    ─► round 1 [a transport that publishes ahead]: publish; each engine checks the
       payload (stage_weights), still generating; round 2 is sent at once behind it
       (an engine takes its commands in order, so its check comes first)
    ─► round 2: swap_weights on every engine at once; each, between two decode
       steps: abort | keep | recompute its running generations (``in_flight``),
       apply (checksums verified; a staged payload only copied), drop prefix
       caches, generate again; it reports the version it now holds (the target)
    ─► an engine that refused or failed gets one full retry (its own swap again)
    ─► still failing: engines already moved are reverted (when the source can) ─► SyncFailed

Colocated (the KV cache is freed for the push), round 1 is ``prepare_swap``
(pause, abort in ``abort`` mode, ``sleep(1)``), the encode runs after it, and
the swap (``asleep=True``) wakes the KV cache again.

Encoding before the pause is safe: only a push changes an engine's weights or
version, and the source's weights are read only until the update is encoded
(``released``). It keeps the engines generating through the trainer's encode;
colocated, the encode waits for ``sleep(1)`` so its payload never shares the
device with the KV cache.

An engine here is a :class:`~contracts.handles.WeightReceiver` (``swap_weights``,
``prepare_swap``, ``stage_weights``, ``get_version``; ``wake_up``,
``reset_prefix_cache``, ``resume`` for :func:`resume_engines`) — the engine itself
or a rollout actor's handle — that takes the handles the push's transport publishes.

A source is a :class:`WeightUpdate` (fixed; no retry possible), a
:class:`~sync.encode.WeightSender` with ``weights=`` and ``version=``, or a
:class:`~contracts.handles.WeightSource`: ``weight_update()`` and optionally
``weights_refused()`` and ``revert_update()`` (undo on a failed push), sync or
async (the trainer's handle).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar, cast

import msgspec

from contracts.handles import WeightReceiver, WeightSource
from contracts.rollout import GenerateOutput, InFlight, SwapReport
from contracts.weights import WeightUpdate
from sync.apply import stageable
from sync.encode import NamedTensors, WeightSender
from sync.errors import BaseVersionMismatch, SyncFailed, WeightSyncError
from sync.metrics import SyncMetrics, SyncResult
from sync.resume import Resumable, resume_engine
from sync.transport import Transport, make_transport

H = TypeVar("H")  # the handle the push's transport publishes and its engines take
R = TypeVar("R")

#: What a push sends from: a fixed update, a sender (with ``weights=``), or the trainer's handle.
Source = WeightUpdate | WeightSender | WeightSource
#: The weights a ``WeightSender`` source encodes, or a function that reads them when the encode runs.
Weights = NamedTensors | Callable[[], NamedTensors]


async def _maybe_await(x: Awaitable[R] | R) -> R:
    return await x if inspect.isawaitable(x) else x


#: The version each engine (or actor handle) reported at its last swap. A push
#: asks only the engines it has not heard from (a joining actor, a first push),
#: so that it costs each engine at most two control rounds: the check of the
#: published payload and the swap. Forgotten when a swap fails.
_KNOWN: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()


def _known(engine: object, version: int) -> None:
    try:
        _KNOWN[engine] = int(version)
    except TypeError:  # an engine that cannot be weakly referenced is asked every time
        pass


async def engine_version(engine: WeightReceiver[H], *, fresh: bool = False) -> int:
    """The version an engine or actor handle holds (``get_version()``; a
    stand-in's ``.version``): as its last swap reported it, unless ``fresh`` or
    none is known."""
    if not fresh:
        try:
            return _KNOWN[engine]
        except (KeyError, TypeError):
            pass
    if hasattr(engine, "get_version"):
        return int(await engine.get_version())
    return int(getattr(engine, "version"))  # a stand-in with the property only


class _Source:
    """Uniform view of the three kinds of source."""

    def __init__(self, source: Source, weights: Weights | None, version: int | None,
                 released: asyncio.Event | None = None) -> None:
        self.source, self.weights, self.version, self.released = source, weights, version, released
        self.encode_ms = 0.0
        if isinstance(source, WeightSender) and (weights is None or version is None):
            raise ValueError("sync_weights with a WeightSender needs weights= and version=")

    @property
    def can_retry(self) -> bool:
        # once released, the source's weights may already be a later version's
        return not isinstance(self.source, WeightUpdate) and not (self.released and self.released.is_set())

    def _weights(self) -> NamedTensors:
        w = self.weights
        assert w is not None
        return w() if callable(w) and not isinstance(w, Mapping) else w

    async def update(self, full: bool = False) -> WeightUpdate:
        t0 = time.perf_counter()
        s = self.source
        if isinstance(s, WeightUpdate):
            update = s
        elif isinstance(s, WeightSender):
            if full:
                s.force_full()
            assert self.version is not None
            update = s.encode(self._weights(), self.version)
        else:
            if full and hasattr(s, "weights_refused"):
                await _maybe_await(s.weights_refused())
            published = await _maybe_await(s.weight_update())
            assert published is not None, "a weight source published no update"
            update = published
        self.encode_ms += (time.perf_counter() - t0) * 1e3
        return update

    async def revert(self) -> WeightUpdate | None:
        fn: Callable[[], Awaitable[WeightUpdate | None] | WeightUpdate | None] | None = getattr(
            self.source, "revert_update", None)
        return await _maybe_await(fn()) if fn is not None else None


async def sync_weights(
    engines: Sequence[WeightReceiver[H]],
    source: Source,
    *,
    colocated: bool,
    in_flight: InFlight = "abort",
    weights: Weights | None = None,
    version: int | None = None,
    transport: Transport[H] | None = None,
    released: asyncio.Event | None = None,
    ask_versions: bool = False,
) -> SyncResult:
    """Bring every engine to the source's next version, safely.

    ``in_flight``: what each engine's swap does to the generations running on it
    (``contracts.rollout.InFlight``). ``ask_versions``: ask every engine its version
    first instead of using the ones its last swap reported (a broadcast waits for
    every member: the question finds a dead one before the collective starts).
    ``released`` is set as soon as the update is encoded: from then on the
    source's weights are not read again, so a trainer may take its next step
    while the push runs. A failed push is then not retried with a fresh full
    encode (it would read the newer weights); engines are reverted instead.

    Returns a :class:`SyncResult` with what each engine aborted (an engine: the
    partial outputs; a rollout actor keeps those and returns their count) and
    the :class:`SyncMetrics`. On failure raises :class:`~sync.errors.SyncFailed`
    naming the engine; engines generate again either way and none is left on a
    different version from the others when the source can revert (a
    ``WeightSender``), else ``versions`` says where each is.
    """
    transport = transport or cast(Transport[H], make_transport("inproc"))
    src = _Source(source, weights, version, released)
    t0 = time.perf_counter()
    staged: _Staged[H] | None = None
    aborted: list[list[GenerateOutput] | int] = [[] for _ in engines]
    if colocated:  # the KV cache is freed before the encode: the payload never shares the device with it
        aborted = list(await asyncio.gather(*(e.prepare_swap(in_flight) for e in engines)))
        try:
            before, update = await _prepare(engines, src, ask_versions)
        except BaseException:
            await resume_engines(engines, colocated=True)
            raise
    else:
        before, update = await _prepare(engines, src, ask_versions)
        staged = _stage(engines, update, transport)
    target = update.manifest.version
    metrics = SyncMetrics(version=target, kind=update.manifest.kind, bytes_sent=0,
                          changed_fraction=update.manifest.changed_fraction, encode_ms=src.encode_ms,
                          transfer_ms=0.0, apply_ms=0.0, num_engines=len(engines))
    if staged is not None:
        metrics.transfer_ms = staged.send_ms
    swap = functools.partial(_swap, engines, transport=transport, metrics=metrics, in_flight=in_flight)
    errors = await swap(range(len(engines)), update, asleep=colocated, aborted=aborted, staged=staged)
    if errors and src.can_retry:
        metrics.num_full_retries = 1
        errors = await swap(sorted(errors), await src.update(full=True), aborted=aborted)
    if errors:
        await _revert(engines, before, target, src, swap)
        i, err = min(errors.items())
        versions = list(await asyncio.gather(*(engine_version(e, fresh=True) for e in engines)))
        raise SyncFailed(f"weight push to version {target} failed: {err!r}", i, versions) from err
    metrics.encode_ms = src.encode_ms
    metrics.sender_encode_ms = update.manifest.encode_ms
    metrics.source_ms = update.manifest.source_ms
    metrics.device_plan = bool(update.manifest.layout)
    metrics.num_aborted = sum(a if isinstance(a, int) else len(a) for a in aborted)
    metrics.total_ms = (time.perf_counter() - t0) * 1e3
    return SyncResult(version=target, metrics=metrics, aborted=aborted)


async def resume_engines(engines: Sequence[Resumable], *, colocated: bool) -> None:
    """:func:`~sync.resume.resume_engine` on every engine at once."""
    await asyncio.gather(*(resume_engine(e, colocated=colocated) for e in engines))


async def _prepare(engines: Sequence[WeightReceiver[H]], src: _Source, fresh: bool) -> tuple[list[int], WeightUpdate]:
    """The engines' versions and the update for them: a delta only when every
    engine holds its base (when the source can re-encode), else full for all."""
    before = list(await asyncio.gather(*(engine_version(e, fresh=fresh) for e in engines)))
    update = await src.update()
    if update.manifest.kind == "delta" and any(v != update.manifest.base_version for v in before) and src.can_retry:
        update = await src.update(full=True)  # someone missed the base: everyone gets full
    if src.released is not None:
        src.released.set()
    return before, update


class _Staged(msgspec.Struct, Generic[H]):
    handle: H
    send_ms: float
    checks: asyncio.Future[list[bool | BaseException]]  # the engines' stage_weights calls, running (asyncio.gather)
    t0: float
    t1: float = 0.0  # when the last check replied

    async def finish(self, metrics: SyncMetrics) -> None:
        """Wait for the checks (the payload must outlive them): ``stage_ms``, from
        the publish to the last reply. Their failures are the apply's to report."""
        for r in await self.checks:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r  # cancellation and the like
        metrics.stage_ms = (self.t1 - self.t0) * 1e3


def _stage(engines: Sequence[WeightReceiver[H]], update: WeightUpdate, transport: Transport[H]) -> _Staged[H] | None:
    """Publish ``update`` and let every engine that can check it now, while it
    still generates (``stage_weights``), so that the apply with the engines
    paused only copies. The checks are sent, not awaited: the swap goes out
    right behind them, and each engine runs its commands in order. Best effort:
    a check that fails here is made again by the apply, which reports it. None
    when the transport cannot publish ahead (a broadcast needs every engine in
    step), an engine cannot check ahead, or the update is not one a check ahead
    takes (a planned full update)."""
    if (not stageable(update.manifest) or not getattr(transport, "can_stage", False)
            or not all(hasattr(e, "stage_weights") for e in engines)):
        return None
    t0 = time.perf_counter()
    handle = transport.send(update)
    t1 = time.perf_counter()
    staged = _Staged(handle, (t1 - t0) * 1e3, asyncio.gather(*(e.stage_weights(handle) for e in engines),
                                                             return_exceptions=True), t1)
    staged.checks.add_done_callback(lambda _: setattr(staged, "t1", time.perf_counter()))
    return staged


class _SwapFn(Protocol):
    async def __call__(self, which: Iterable[int], update: WeightUpdate, *,
                       aborted: list[list[GenerateOutput] | int], asleep: bool = False,
                       staged: _Staged[H] | None = None) -> dict[int, BaseException]: ...


async def _swap(engines: Sequence[WeightReceiver[H]], which: Iterable[int], update: WeightUpdate, *,
                transport: Transport[H], metrics: SyncMetrics, in_flight: InFlight,
                aborted: list[list[GenerateOutput] | int], asleep: bool = False,
                staged: _Staged[H] | None = None) -> dict[int, BaseException]:
    """Swap ``update`` into ``engines[i]`` for i in ``which`` (through the payload
    :func:`_stage` published, when it did): one ``swap_weights`` call each,
    which ends with the engine generating again; return the failures. What an
    engine aborted goes into ``aborted[i]``; the version it reports, into the
    versions known for the next push."""
    which = list(which)
    t0 = time.perf_counter()
    handle = transport.send(update) if staged is None else staged.handle
    t1 = time.perf_counter()
    results = await asyncio.gather(*(engines[i].swap_weights(handle, in_flight, asleep) for i in which),
                                   return_exceptions=True)
    t2 = time.perf_counter()
    try:
        if staged is not None:
            await staged.finish(metrics)
    finally:
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
            _KNOWN.pop(engines[i], None)
            errors[i] = r
            continue
        _known(engines[i], r.version)
        metrics.paused_ms = max(metrics.paused_ms, r.paused_ms)
        metrics.engine_apply_ms = max(metrics.engine_apply_ms, r.apply_ms)
        if r.aborted:
            aborted[i] = r.aborted
        if r.version != update.manifest.version:
            errors[i] = WeightSyncError(f"engine returned version {r.version}, expected {update.manifest.version}")
    return errors


async def _revert(engines: Sequence[WeightReceiver[H]], before: list[int], target: int, src: _Source,
                  swap: _SwapFn) -> None:
    """Put engines that already moved to ``target`` back on their previous version."""
    now = await asyncio.gather(*(engine_version(e, fresh=True) for e in engines))
    moved = [i for i, v in enumerate(now) if v != before[i]]
    if not moved:
        return
    undo = await src.revert()
    if undo is None:
        return  # cannot: SyncFailed.versions will show the split
    await swap(moved, undo, aborted=[[] for _ in engines])


__all__ = ["BaseVersionMismatch", "engine_version", "resume_engine", "resume_engines", "sync_weights"]
