"""The rollout-engine protocol shared by the built-in torch engine and the
vLLM / SGLang adapters.

Token ids in; token ids, per-token log-probs, the weight version of every
token and a finish reason out. The mapping onto the external engines:

    this protocol            vLLM AsyncLLM                      SGLang HTTP server
    generate/stream          generate()                         POST /generate (stream: server-sent events)
    abort(ids|None)          abort() -> partial RequestOutput   POST /abort_request
    pause()/resume()         pause_generation(mode=...)         /pause_generation (abort) + /continue_generation
    sleep(1|2)/wake_up(tags) sleep(level)/wake_up(tags)         /release_memory_occupation, /resume_memory_occupation
    update_weights(update)   collective_rpc (reload_weights)    /update_weights_from_disk (a host copy, checked)
    reset_prefix_cache()     reset_prefix_cache()               /flush_cache

An engine implements six methods: :meth:`~RolloutEngine.setup`,
:meth:`~RolloutEngine.stream`, :meth:`~RolloutEngine.abort`,
:meth:`~RolloutEngine.update_weights`, and the two switches that the verbs
callers use sit on: ``_set_paused`` (``pause``/``resume``) and ``_set_memory``
(``sleep``/``wake_up``, whose arguments are checked here, once for every engine).
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator
from typing import TypeAlias

from actors.engines.weights import FullWeights
from contracts.rollout import IN_FLIGHT_MODES, GenerateOutput, GenerateRequest, InFlight, SamplingParams, SwapReport
from contracts.weights import WeightUpdate
from sync.resume import resume_engine

__all__ = ["MEMORY_TAGS", "EngineAsleepError", "EngineUpdate", "GenerateOutput", "GenerateRequest", "RolloutEngine",
           "SamplingParams", "SwapReport", "check_in_flight", "copy_output"]

#: What an engine applies: a ``sync`` update (full or delta; its buckets may be a
#: transport's references, read as the apply goes), or a full set of named weights.
EngineUpdate: TypeAlias = WeightUpdate | FullWeights

#: What ``sleep`` frees and ``wake_up`` restores, by name (``wake_up(None)``: both).
MEMORY_TAGS = ("weights", "kv_cache")


def check_in_flight(mode: str) -> None:
    if mode not in IN_FLIGHT_MODES:
        raise ValueError(f"in_flight={mode!r} is not one of {list(IN_FLIGHT_MODES)}")


class EngineAsleepError(RuntimeError):
    """Raised when asked to generate while the engine sleeps."""


def copy_output(out: GenerateOutput) -> GenerateOutput:
    """A copy of ``out`` whose lists the engine's stream can go on filling."""
    return GenerateOutput(request_id=out.request_id, token_ids=list(out.token_ids), logprobs=list(out.logprobs),
                          raw_logprobs=list(out.raw_logprobs), token_versions=list(out.token_versions),
                          finish_reason=out.finish_reason)


class RolloutEngine(abc.ABC):
    """A generation engine owned by one rollout actor (one event loop)."""

    _version: int = 0  # the weight version held; implementations raise it in update_weights

    # ---- what an engine implements -----------------------------------------------------------
    @abc.abstractmethod
    async def setup(self) -> None:
        """Load weights, allocate caches, start the generation loop."""

    @abc.abstractmethod
    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yield cumulative outputs as tokens arrive; the last has a finish_reason."""

    @abc.abstractmethod
    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        """Stop the given requests (all when ``None``); return their partial
        outputs with ``finish_reason='abort'``. Their streams end with the same."""

    @abc.abstractmethod
    async def update_weights(self, update: EngineUpdate) -> int:
        """Apply a ``sync`` weight update (full or delta); return the new version.
        Invalidates every cache computed with the old weights."""

    @abc.abstractmethod
    async def _set_paused(self, paused: bool) -> None:
        """``True``: stop scheduling new decode steps (admitted requests wait);
        ``False``: go on. Behind :meth:`pause` and :meth:`resume`."""

    @abc.abstractmethod
    async def _set_memory(self, tags: list[str], *, resident: bool) -> None:
        """Free (``resident=False``: ``["kv_cache"]`` for sleep level 1, ``["kv_cache",
        "weights"]`` for level 2) or restore (``resident=True``: any of :data:`MEMORY_TAGS`)
        what ``tags`` name. Behind :meth:`sleep` and :meth:`wake_up`, which check the tags."""

    # ---- the verbs callers use ---------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Run one request to completion (or abort) and return its output."""
        last = GenerateOutput(request_id=request.request_id)
        async for out in self.stream(request):
            last = out
        return last

    async def pause(self) -> None:
        """Stop scheduling new decode steps (admitted requests wait)."""
        await self._set_paused(True)

    async def resume(self) -> None:
        """Undo :meth:`pause`."""
        await self._set_paused(False)

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and also the weights (level 2)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level} must be 1 (KV cache) or 2 (KV cache and weights)")
        await self._set_memory(["kv_cache"] + (["weights"] if level == 2 else []), resident=False)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed (``tags``: "weights", "kv_cache"; None = all)."""
        tags = list(MEMORY_TAGS) if tags is None else list(tags)
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)} unknown (use 'weights', 'kv_cache')")
        await self._set_memory(tags, resident=True)

    async def prepare_swap(self, in_flight: InFlight = "abort") -> list[GenerateOutput]:
        """The first half of a swap that frees the KV cache (colocated with the
        trainer): pause, abort the running generations (``abort`` mode; the
        others are preempted by the sleep and recomputed after), ``sleep(1)``.
        Returns what was aborted; :meth:`swap_weights` with ``asleep=True`` ends it."""
        check_in_flight(in_flight)
        await self.pause()
        aborted = await self.abort(None) if in_flight == "abort" else []
        await self.sleep(1)
        return aborted

    async def swap_weights(self, update: EngineUpdate, in_flight: InFlight = "abort", asleep: bool = False) -> SwapReport:
        """The whole weight swap, run by the engine: stop generating, deal with
        the running generations as ``in_flight`` says, apply ``update``
        (:meth:`update_weights`), [``asleep``: after :meth:`prepare_swap`, wake
        the KV cache], drop prefix caches, go on. Whatever becomes of the apply,
        the engine generates again when this returns or raises. This default
        composes the verbs (an HTTP engine: ``abort`` only, its ``update_weights``
        drops every running request's KV); the built-in engine runs it as one
        step of its own between two decode steps."""
        check_in_flight(in_flight)
        if in_flight != "abort" and not asleep:
            raise ValueError(f"{type(self).__name__} cannot keep generations running across a weight update "
                             f"(sync.in_flight={in_flight!r}); use 'abort'")
        t0 = time.perf_counter()
        aborted: list[GenerateOutput] = []
        try:
            if not asleep:
                await self.pause()
                aborted = await self.abort(None)
            t1 = time.perf_counter()
            version = await self.update_weights(update)
            apply_ms = (time.perf_counter() - t1) * 1e3
        finally:
            await resume_engine(self, colocated=asleep)
        return SwapReport(version=version, aborted=aborted, paused_ms=(time.perf_counter() - t0) * 1e3,
                          apply_ms=apply_ms)

    async def stage_weights(self, update: EngineUpdate) -> bool:
        """Check ``update`` ahead of :meth:`update_weights`, writing nothing,
        while requests still run, so that the apply with the engine paused
        only copies. True when checked; False (the default) when
        :meth:`update_weights` checks as it applies. Raises for a corrupt payload."""
        return False

    async def reset_prefix_cache(self) -> None:
        """Drop any prefix / KV cache reuse state (the default: the engine keeps none)."""

    @property
    def version(self) -> int:
        """The weight version the engine holds now."""
        return self._version

    async def get_version(self) -> int:
        """:attr:`version`, as a rollout actor's handle gives it (``contracts.handles.WeightReceiver``)."""
        return self._version

    def named_weights(self) -> dict[str, object]:
        """The weights the engine holds, by Hugging Face name (read-only views;
        for bit-exactness checks against the trainer). Optional for adapters."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights")

    def statistics(self) -> dict[str, object]:
        """Counters for monitoring (read without locking; approximate while running).
        The default: none."""
        return {}

    async def close(self) -> None:
        """Stop the generation loop and free memory."""
