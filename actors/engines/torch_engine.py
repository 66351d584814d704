"""The built-in rollout engine: pure PyTorch, continuous batching, a
preallocated slot KV cache, CUDA-graph decode on GPU.

The coroutines here run on the caller's event loop; all torch work runs on
the engine's one thread (:mod:`actors.engines.engine_core`), which posts a
request's tokens back with ``loop.call_soon_threadsafe`` when it ends (every
step for :meth:`TorchEngine.stream`): the loop's thread, which shares the
GIL, is woken only when there is news. Per request the loop side keeps a
:class:`_Stream` (the cumulative output and an ``asyncio.Event``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import torch

from actors.engines.base import EngineAsleepError, EngineUpdate, RolloutEngine, check_in_flight, copy_output
from actors.engines.config import CPU_MAX_NUM_SEQS, EngineConfig, check_speculative
from actors.engines.engine_core import EngineCore
from actors.engines.engine_steps import EngineOptions, Event, Seq
from actors.engines.weights import with_tied_head
from contracts.rollout import GenerateOutput, GenerateRequest, InFlight, SwapReport

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULTS = EngineConfig()  # the one set of defaults: the config's
_CLOSE_TIMEOUT_S = 30.0


def _check_weight_dtype(weight_dtype: str, dtype: str, cuda: bool, reference_for_tests: bool) -> None:
    if weight_dtype not in ("auto", "fp8"):
        raise ValueError(f"weight_dtype={weight_dtype!r} is not 'auto' or 'fp8'")
    if weight_dtype == "fp8" and not cuda and not reference_for_tests:
        raise ValueError("weight_dtype='fp8' needs a CUDA device (its GEMMs run on FP8 tensor cores)")
    if weight_dtype == "fp8" and cuda and dtype != "bfloat16":
        raise ValueError(f"weight_dtype='fp8' needs dtype='bfloat16', got {dtype!r}")


class _Stream:
    """Loop-side sink of one request."""

    __slots__ = ("out", "event", "done", "error")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.out = GenerateOutput(request_id=request_id)
        self.event = asyncio.Event()
        self.done: asyncio.Future[GenerateOutput] = loop.create_future()
        self.error: BaseException | None = None


class TorchEngine(RolloutEngine):
    """Built-in engine for Llama / Qwen2 / Qwen3 checkpoints.

    Runs build it with :func:`actors.engines.make_engine` from their
    ``rollout.engine`` section; the keyword defaults here are that section's
    (:class:`~actors.engines.config.EngineConfig`), for direct use in tests and benchmarks.

    ``model_path``: directory with ``config.json`` and ``*.safetensors``.
    ``device``: "cpu" or "cuda[:i]". ``dtype``: "float32" | "bfloat16" |
    "float16" (None or "auto": float32 on CPU, bfloat16 on CUDA). ``max_num_seqs``:
    KV slots = most requests decoded together (None: 128 on CPU; on CUDA sized at
    :meth:`setup` from the free memory, :attr:`max_num_seqs` and ``statistics()``
    then tell). ``max_model_len``: most
    tokens (prompt + response) per request. ``seed``: seeds the per-request
    seeds of unseeded requests. ``cuda_graphs``: replay decode steps as CUDA
    graphs (CUDA only). ``max_prefill_tokens``: padded tokens per prefill batch.
    ``compile_decode``: fuse the decode step's elementwise work with
    ``torch.compile`` (CUDA only; the first step of each batch size compiles);
    a string is a ``torch.compile`` mode, e.g. ``"max-autotune-no-cudagraphs"``.
    ``overlap_steps``: launch decode step k+1 before reading step k's tokens
    back (None: on for CUDA, off for CPU, where launching *is* computing).
    ``weight_dtype``: "fp8" for FP8 linears (CUDA, bfloat16; :mod:`actors.engines.fp8_store`),
    "auto" for weights in ``dtype``. ``fp8_reference_for_tests``: let "fp8" run on a CPU through
    the slow reference GEMM, for tests only.
    ``mtp_layers``: MTP modules the weights hold (``model.mtp_layers``; ``docs/mtp.md``).
    ``speculative``: ``"mtp"`` drafts ``mtp_layers`` tokens a step with them and verifies
    them with the full model (``actors/engines/speculative.py``); ``"off"``.
    """

    def __init__(self, model_path: str, *, device: str = _DEFAULTS.device, dtype: str | None = "auto",
                 max_num_seqs: int | None = _DEFAULTS.max_num_seqs, max_model_len: int = _DEFAULTS.max_model_len,
                 seed: int = 0, cuda_graphs: bool = _DEFAULTS.cuda_graphs, max_prefill_tokens: int = 16384,
                 compile_decode: bool | str = _DEFAULTS.compile_decode, overlap_steps: bool | None = None,
                 weight_dtype: str = _DEFAULTS.weight_dtype, fp8_reference_for_tests: bool = False,
                 mtp_layers: int = 0, speculative: str = _DEFAULTS.speculative, fp8_skip: tuple[str, ...] = ()):
        cuda = str(device).startswith("cuda")
        if dtype in (None, "auto"):
            dtype = "bfloat16" if cuda else "float32"
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        _check_weight_dtype(weight_dtype, dtype, cuda, fp8_reference_for_tests)
        if fp8_skip and weight_dtype != "fp8":
            raise ValueError(f"fp8_skip={list(fp8_skip)} needs weight_dtype='fp8'")
        if max_num_seqs is None and not cuda:
            max_num_seqs = CPU_MAX_NUM_SEQS
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        if max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len} must be >= 2")
        check_speculative(speculative, mtp_layers)
        self.model_path = str(model_path)
        self._device_name = str(device)
        self._dtype = _DTYPES[dtype]
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._seed = seed
        self._cuda_graphs = cuda_graphs
        self._compile_decode = compile_decode
        self._overlap_steps = overlap_steps
        self._weight_dtype, self._fp8_skip = weight_dtype, tuple(fp8_skip)
        self._mtp_layers, self._speculative = mtp_layers, speculative == "mtp"
        self._max_prefill_tokens = max(max_prefill_tokens, max_model_len)
        self._core: EngineCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._version = 0
        self._asleep = False

    @classmethod
    def from_config(cls, cfg: EngineConfig, model_path: str, *, seed: int, mtp_layers: int = 0) -> TorchEngine:
        """The engine ``rollout.engine`` describes (``type: torch``: :mod:`actors.engines.registry`),
        holding ``mtp_layers`` MTP modules (``model.mtp_layers``)."""
        return cls(model_path, device=cfg.device, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
                   max_model_len=cfg.max_model_len, seed=seed, cuda_graphs=cfg.cuda_graphs,
                   compile_decode=cfg.compile_decode, weight_dtype=cfg.weight_dtype, mtp_layers=mtp_layers,
                   speculative=cfg.speculative, fp8_skip=tuple(cfg.fp8_skip))

    # ---- lifecycle -----------------------------------------------------------------------------
    async def setup(self) -> None:
        if self._core is not None:
            raise RuntimeError("TorchEngine.setup() called twice")
        device = torch.device(self._device_name)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={self._device_name!r} but CUDA is not available")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self._loop = asyncio.get_running_loop()
        opts = EngineOptions(self.model_path, device, self._dtype, self.max_num_seqs, self.max_model_len,
                             self._seed, self._cuda_graphs, self._max_prefill_tokens, self._compile_decode,
                             self._overlap_steps, self._mtp_layers, self._speculative,
                             weight_dtype=self._weight_dtype, fp8_skip=self._fp8_skip)
        self._core = EngineCore(opts, self._post)
        self._core.start()
        self._version = await self._call("init")
        self.max_num_seqs = opts.max_num_seqs  # as sized by the engine's thread, where it was None

    async def close(self) -> None:
        if self._core is None or self._core.closed:
            return
        await self._call("close")
        # the thread leaves its loop right after posting that reply: a join of
        # microseconds, done here rather than on an executor thread of its own
        self._core.join(_CLOSE_TIMEOUT_S)

    # ---- thread -> loop ------------------------------------------------------------------------
    def _post(self, events: list[Event], callbacks: list) -> None:
        """Called on the engine thread; runs :meth:`_deliver` on the loop."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, events, callbacks)
        except RuntimeError:  # loop closed: nobody is left to deliver to
            pass

    def _deliver(self, events: list[Event], callbacks: list) -> None:
        for st, tokens, lps, raws, versions, finish, error in events:
            out = st.out
            if tokens:
                out.token_ids += tokens
                out.logprobs += lps
                out.raw_logprobs += raws
                out.token_versions += versions
            if error is not None:
                st.error = error
                self._streams.pop(out.request_id, None)
                if not st.done.done():
                    st.done.set_exception(error)
                    st.done.exception()  # mark retrieved: stream() re-raises it
            elif finish is not None:
                out.finish_reason = finish
                self._streams.pop(out.request_id, None)
                if not st.done.done():
                    st.done.set_result(out)
            st.event.set()
        for cb in callbacks:
            cb()

    async def _call(self, name: str, *args: object) -> Any:
        if self._core is None:
            raise RuntimeError("TorchEngine.setup() was not awaited")
        if self._core.closed:
            raise RuntimeError(f"TorchEngine is closed ({name} not run)")
        fut = self._loop.create_future()

        def done(result: object, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._core.push(name, *args, done)
        return await fut

    # ---- generation ----------------------------------------------------------------------------
    def _submit(self, request: GenerateRequest, streamed: bool) -> _Stream:
        """``streamed``: its tokens come every step (``stream``), not all at its end (``generate``)."""
        if self._core is None:
            raise RuntimeError("TorchEngine.setup() was not awaited")
        if self._core.closed:
            raise RuntimeError("TorchEngine is closed")
        if self._asleep:
            raise EngineAsleepError(f"request {request.request_id!r}: the engine is asleep; call wake_up()")
        if request.request_id in self._streams:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError(f"request {request.request_id!r} has empty prompt_ids")
        if n >= self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: prompt of {n} tokens does not fit "
                             f"max_model_len={self.max_model_len}")
        vocab = self._core.cfg.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            bad = next(t for t in request.prompt_ids if not 0 <= t < vocab)
            raise ValueError(f"request {request.request_id!r}: prompt token id {bad} is outside the "
                             f"model's vocabulary [0, {vocab})")
        sp = request.sampling
        if sp.temperature < 0 or not 0.0 < sp.top_p <= 1.0 or sp.top_k < 0:
            raise ValueError(f"request {request.request_id!r}: bad sampling params {sp}")
        st = _Stream(request.request_id, self._loop)
        self._streams[request.request_id] = st
        seed = -1 if sp.seed is None else sp.seed % (1 << 32)
        self._core.push("submit", Seq(request.request_id, st, list(request.prompt_ids),
                                      request.max_tokens, sp, seed, streamed), None)
        return st

    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if self._asleep:
            raise EngineAsleepError(f"request {request.request_id!r}: the engine is asleep; call wake_up()")
        return self._stream(request)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        st = self._submit(request, streamed=True)
        try:
            while True:
                await st.event.wait()
                st.event.clear()
                if st.error is not None:
                    raise RuntimeError(f"request {request.request_id!r} failed in the engine") from st.error
                out = st.out
                yield copy_output(out)
                if out.finish_reason is not None:
                    return
        finally:
            if st.out.finish_reason is None and st.error is None and not self._core.closed:
                self._core.push("abort", [request.request_id], None)  # consumer left early

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        st = self._submit(request, streamed=False)
        try:
            return await asyncio.shield(st.done)
        except asyncio.CancelledError:
            self._core.push("abort", [request.request_id], None)
            raise
        except Exception as exc:
            raise RuntimeError(f"request {request.request_id!r} failed in the engine") from exc

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        streams = await self._call("abort", None if request_ids is None else list(request_ids))
        return [st.out for st in streams]

    # ---- control -------------------------------------------------------------------------------
    async def _set_paused(self, paused: bool) -> None:
        await self._call("pause" if paused else "resume")

    async def _set_memory(self, tags: list[str], *, resident: bool) -> None:
        if resident:
            self._asleep = not await self._call("wake", list(tags))
            return
        self._asleep = True
        await self._call("sleep", 2 if "weights" in tags else 1)

    async def update_weights(self, update: EngineUpdate) -> int:
        self._version = await self._call("update", update)
        return self._version

    async def swap_weights(self, update: EngineUpdate, in_flight: InFlight = "abort", asleep: bool = False) -> SwapReport:
        """The whole swap in one step of the engine's thread, between two decode
        steps (see ``EngineCore._cmd_swap``): no pause/resume round trips."""
        check_in_flight(in_flight)
        try:
            version, streams, paused_ms, apply_ms = await self._call("swap", update, in_flight, asleep)
        finally:
            if asleep:
                self._asleep = not self._core.awake
        self._version = version
        return SwapReport(version=version, aborted=[st.out for st in streams], paused_ms=paused_ms,
                          apply_ms=apply_ms)

    async def stage_weights(self, update: EngineUpdate) -> bool:
        return bool(await self._call("stage", update))

    async def reset_prefix_cache(self) -> None:
        await self._call("reset_prefix_cache")

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine computes with, by HF name: live views, not
        copies (read them between updates; do not write them). A tied
        ``lm_head.weight`` is listed too, as the embedding, like ``state_dict()``."""
        if self._core is None or not hasattr(self._core, "weights"):
            raise RuntimeError("TorchEngine.setup() was not awaited")
        store = self._core.weights
        return with_tied_head(store.params, store.cfg.tie_word_embeddings)

    def statistics(self) -> dict[str, object]:
        """Counts for monitoring (read without locking; approximate while running)."""
        core = self._core
        return {
            "num_running": len(core.running) if core else 0,
            "num_waiting": len(core.waiting) if core else 0,
            "num_preemptions": core.num_preemptions if core else 0,
            "max_num_seqs": self.max_num_seqs or 0,  # 0: not sized yet (before setup, on CUDA)
            "kv_cache_bytes": core.kv.nbytes if core and hasattr(core, "kv") else 0,
            "weights_bytes": core.weights.nbytes if core and hasattr(core, "weights") else 0,
            **(core.weights.statistics() if core and hasattr(core, "weights") else {}),  # fp8: kernel, refusals
            "num_generated_tokens": core.num_generated_tokens if core else 0,
            "graph_capture_s": core.graph_capture_s if core else 0.0,
            **(core.timing if core else {}),
            **({"thread_cpu_s": cpu} if core and (cpu := core.thread_cpu_s()) is not None else {}),
        }
