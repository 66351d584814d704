"""The generation loop of the torch engine: one dedicated thread per engine.

    event loop ── commands (deque + Condition) ──► engine thread
    event loop ◄── loop.call_soon_threadsafe(deliver, events, callbacks) ──┘

Each turn of the thread:
  1. drain commands in order: submit, abort, pause/resume, sleep/wake,
     weight update (applied here, between decode steps, before any new
     request is prefilled), reset_prefix_cache, close; any but ``submit``
     first finishes the decode step in flight (a submit only queues);
  2. unless paused or asleep: admit waiting requests into free slots and
     prefill them (sampling their first token), then run ONE decode step
     for every running request;
  3. post what the turn ended (a request's tokens, all at once) and the
     streamed requests' new tokens: one callback, only in a turn that has any.

Everything that touches torch runs on this thread. Requests preempted by a
weight update or by ``sleep`` keep their tokens and are prefilled again from
prompt + generated tokens, so no KV computed with old weights is reused.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from actors.engines.base import EngineUpdate

R = TypeVar("R")

from actors.engines.config import CUDA_MAX_NUM_SEQS
from actors.engines.cuda_graphs import DecodeGraphs
from actors.engines.engine_steps import EngineOptions, Event, Seq
from actors.engines.fp8_store import Fp8WeightStore
from actors.engines.kv_cache import KVCache, SlotTable, slots_that_fit
from actors.engines.model import Model, ModelConfig
from actors.engines.mtp_model import DraftKVCache
from actors.engines.speculative import SpeculativeScheduler
from actors.engines.weights import FullWeights, WeightStore, update_targets
from sync.apply import apply_update, stage_update

__all__ = ["EngineCore", "EngineOptions", "Event", "Seq"]

# Commands that leave the running set alone, so a decode step in flight stays in flight: a
# submit only queues; a stage reads the update (on its own stream on CUDA, so its check runs
# beside the step instead of after it). Any other command reads back the step first.
_KEEP_CHAIN = frozenset({"submit", "stage"})
#: ``rollout.engine.max_num_seqs: null`` on CUDA: the share of the memory free at setup its KV cache may take.
_KV_SHARE_OF_FREE = 0.5
_log = logging.getLogger(__name__)


class EngineCore(SpeculativeScheduler):
    """Owns model, weights, KV cache and scheduling; lives on its thread. This
    half takes the loop's commands; :class:`Scheduler` runs the steps."""

    def __init__(self, opts: EngineOptions, post: Callable[[list[Event], list[Callable[[], None]]], None]):
        self.opts = opts
        self._post = post
        self._cond = threading.Condition()
        self._commands: deque[tuple] = deque()
        self._thread = threading.Thread(target=self._main, name="asyncrl-torch-engine", daemon=True)
        self.version = 0
        self.paused = False
        self.closed = False
        self.running: list[Seq] = []  # running[i].slot == i; replaced, never changed in place
        self.waiting: deque[Seq] = deque()
        self._rng = random.Random(opts.seed)
        self._batch = None  # what the running set's decode steps share (Scheduler._batch_for)
        self._ended: list[Seq] = []  # running requests ended since the last compaction (idle rows)
        self._stop_ids: set[int] = set()
        self._stop_tensor = torch.zeros(0, dtype=torch.int64)
        self.num_generated_tokens = 0
        self.num_preemptions = 0
        self._inflight = None  # the decode step in flight (Scheduler._decode)
        self._stage_stream = None  # CUDA: where a stage checks a payload beside the decode step in flight
        self._admit_wait = 0  # turns the oldest waiting request has been held back
        self._pinned_turn = 0
        # where decode time goes: launching (CPU), waiting for the device, bookkeeping (CPU);
        # per turn of the data path (admission, prefill, decode, posting): its whole time, the
        # model's forward calls and the sampler's (CPU: compute; CUDA: launches) and every wait
        # for the device (prefill's first tokens too); how often a step in flight was read back
        # before the next could be launched from its tokens on the device (overlap only)
        self.graph_capture_s = 0.0  # CUDA graphs: capturing every batch-size bucket at start
        self.timing = {"num_chain_breaks": 0, "num_decode_steps": 0, "decode_launch_s": 0.0, "decode_wait_s": 0.0,
                       "decode_post_s": 0.0, "prefill_s": 0.0, "num_prefills": 0, "num_prefill_seqs": 0,
                       "num_turns": 0, "turn_s": 0.0, "forward_s": 0.0, "sample_s": 0.0, "device_wait_s": 0.0,
                       "num_spec_steps": 0, "num_draft_tokens": 0, "num_accepted_draft_tokens": 0}

    # ---- called from the event loop ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def thread_cpu_s(self) -> float | None:
        """CPU seconds the engine's thread has used (Linux; None elsewhere or once it ended):
        beside the decode timings, how much of a step the host spends running Python."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (AttributeError, OSError, TypeError):  # no such clock here, thread not started or gone
            return None

    def push(self, *command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    # ---- the thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        if self.opts.device.type == "cuda":
            # The engine's own stream: its steps run beside a colocated trainer's kernels
            # instead of queueing behind them on the default stream, and its host-to-device
            # copies wait only for its own work.
            torch.cuda.set_device(self.opts.device)
            torch.cuda.set_stream(torch.cuda.Stream(self.opts.device))
        while not self.closed:
            with self._cond:
                while not self._commands and not self._can_step():
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
            if self._inflight is not None and any(cmd[0] not in _KEEP_CHAIN for cmd in commands):
                events: list[Event] = []
                self._drain(events)
                if events:
                    self._post(events, [])
            for cmd in commands:
                self._handle(cmd)
            if self._can_step():
                try:
                    self._step()
                except Exception as exc:  # a broken step fails its requests, not the engine
                    self._fail_all(exc)
        with self._cond:  # whatever came in after close gets an answer, not a hang
            left, self._commands = list(self._commands), deque()
        for name, *_, done in left:
            if done is not None:
                exc = RuntimeError(f"TorchEngine is closed ({name} not run)")
                self._post([], [lambda exc=exc: done(None, exc)])

    def _can_step(self) -> bool:
        return (not self.closed and not self.paused and self.awake
                and bool(self.running or self.waiting))

    @property
    def awake(self) -> bool:
        return hasattr(self, "kv") and self.kv.allocated and self.weights.device == self.opts.device

    def _handle(self, cmd: tuple) -> None:
        name, *args, done = cmd
        try:
            result = getattr(self, "_cmd_" + name)(*args)
        except BaseException as exc:  # the caller gets it, the thread goes on
            if done is not None:
                self._post([], [lambda exc=exc: done(None, exc)])  # `exc` is unbound after except
            return
        if name == "abort":
            events, streams = result
            self._post(events, [] if done is None else [lambda: done(streams, None)])
        elif done is not None:
            self._post([], [lambda: done(result, None)])

    # ---- commands ------------------------------------------------------------------------------
    def _cmd_init(self) -> int:
        o = self.opts
        cuda = o.device.type == "cuda"
        torch.manual_seed(o.seed)
        self.cfg = ModelConfig.from_dir(o.model_path)
        fp8 = o.weight_dtype == "fp8"  # FP8 copies of the linears beside the master (actors.engines.fp8_store)
        self.weights = (Fp8WeightStore if fp8 else WeightStore)(
            self.cfg, o.device, o.dtype, mtp_layers=o.mtp_layers, **({"skip": o.fp8_skip} if fp8 else {}))
        self.weights.load_dir(o.model_path)
        # cache length rounded up to 16: aligned rows for the fused attention kernels' masks
        cache_len = -(-o.max_model_len // 16) * 16
        self.model = Model(self.cfg, cache_len, o.device, o.dtype,
                           compile_decode=o.compile_decode if cuda else False, fp8_weights=fp8)
        if o.max_num_seqs is None:  # rollout.engine.max_num_seqs: null, on CUDA (a CPU config has 128)
            o.max_num_seqs = self._fitting_num_seqs()
        self.kv = (DraftKVCache(self.cfg, o.mtp_layers, o.max_num_seqs, cache_len, o.device, o.dtype) if o.speculative
                   else KVCache(self.cfg.num_layers, o.max_num_seqs, self.cfg.num_kv_heads, cache_len,
                                self.cfg.head_dim, o.device, o.dtype))
        self._readback_dtype = torch.float32 if self.cfg.vocab_size <= 1 << 24 else torch.float64  # exact ids
        self.table = SlotTable(o.max_num_seqs, o.max_model_len, self._readback_dtype)
        self._noise = torch.Generator(device=o.device)
        self._noise.manual_seed(o.seed)
        self._pinned = [torch.empty(3 * o.max_num_seqs, dtype=torch.float64, pin_memory=True)
                        for _ in range(2)] if cuda else []
        graphs = o.cuda_graphs and cuda and not o.speculative  # speculative steps run eager
        self.graphs = DecodeGraphs(self.model, o.max_num_seqs, o.device) if graphs else None
        if self.graphs is not None:  # at start, not in the first steps of a run: each bucket once
            t0 = time.perf_counter()
            self.graphs.capture_all(self.weights, self.kv)
            self.graph_capture_s = time.perf_counter() - t0
        return self.version

    def _fitting_num_seqs(self) -> int:
        """The most sequences, up to :data:`CUDA_MAX_NUM_SEQS`, whose KV cache of ``max_model_len``
        tokens fits in :data:`_KV_SHARE_OF_FREE` of the device memory free now (weights loaded;
        a colocated trainer's, decode graphs and activations take from the rest). Logged once."""
        o = self.opts
        free_bytes, _ = torch.cuda.mem_get_info(o.device)
        num_layers = self.cfg.num_layers + (o.mtp_layers if o.speculative else 0)  # the drafts' KV too
        n = slots_that_fit(int(free_bytes * _KV_SHARE_OF_FREE), num_layers, self.cfg.num_kv_heads,
                           -(-o.max_model_len // 16) * 16, self.cfg.head_dim, o.dtype, CUDA_MAX_NUM_SEQS)
        _log.info("rollout.engine.max_num_seqs: %d (KV cache of %d tokens each within %.0f%% of %.1f GiB free on %s)",
                  n, o.max_model_len, 100 * _KV_SHARE_OF_FREE, free_bytes / 2**30, o.device)
        return n

    def _cmd_submit(self, seq: Seq) -> None:
        if seq.seed < 0:
            seq.seed = self._rng.getrandbits(32)
        if seq.max_tokens <= 0:
            self._post([(seq.stream, [], [], [], [], "length", None)], [])
            return
        seq.num_prompt = len(seq.tokens)
        seq.last_pos = min(len(seq.tokens) + seq.max_tokens, self.opts.max_model_len) - 1
        seq.version_marks.append((0, self.version))
        self.waiting.append(seq)

    def _cmd_abort(self, request_ids: list[str] | None) -> tuple[list[Event], list[object]]:
        wanted = None if request_ids is None else set(request_ids)
        hit = [s for s in (*self.running, *self.waiting)
               if s.finish is None and (wanted is None or s.request_id in wanted)]  # not idle rows: ended
        events = [self._end(s, "abort") for s in hit]  # before the compaction moves their slots
        for s in hit:
            if s.slot >= 0:
                self._end_running(s, "abort")
            else:
                s.finish = "abort"
        self.waiting = deque(s for s in self.waiting if s.finish is None)
        self._compact()
        return events, [s.stream for s in hit]

    def _cmd_pause(self) -> None:
        self.paused = True

    def _cmd_resume(self) -> None:
        self.paused = False

    def _cmd_sleep(self, level: int) -> None:
        self._preempt_all()
        if self.graphs is not None:
            self.graphs.reset()
        self.kv.free()
        if level >= 2:
            self.weights.to(torch.device("cpu"))
        if self.opts.device.type == "cuda":
            torch.cuda.empty_cache()

    def _cmd_wake(self, tags: list[str]) -> bool:
        if "weights" in tags:
            self.weights.to(self.opts.device)
        if "kv_cache" in tags:
            self.kv.allocate()
        return self.awake

    def _cmd_update(self, update: object) -> int:
        return self._on_update_tensors(self._apply_update, update)

    def _cmd_swap(self, update: object, in_flight: str, asleep: bool) -> tuple[int, list[object], float, float]:
        """The whole swap as one command, between two decode steps (the step in
        flight was drained before it): ``abort`` ends every request with its
        partial tokens (posted before the apply, so they end even if it fails);
        ``keep`` leaves the running requests on their KV cache, to continue under
        the new weights; ``recompute`` sends them back to the head of the queue,
        tokens kept, to be prefilled again with the new weights. ``asleep``
        (after ``sleep(1)``): the KV cache is allocated again. The engine runs on
        after it, apply failed or not. Returns (version, the aborted streams,
        the command's and the apply's milliseconds)."""
        t0 = time.perf_counter()
        streams: list[object] = []
        if in_flight == "abort":
            events, streams = self._cmd_abort(None)
            self._post(events, [])
        try:
            t1 = time.perf_counter()
            self._set_version(self._on_update_tensors(self._apply_weights, update))
            apply_ms = (time.perf_counter() - t1) * 1e3
            if in_flight == "recompute":
                self._preempt_all()
        finally:
            if asleep:
                self._cmd_wake(["kv_cache"])
            self.paused = False
        return self.version, streams, (time.perf_counter() - t0) * 1e3, apply_ms

    def _cmd_stage(self, update: object) -> bool:
        """Check ``update`` ahead of its apply, between decode steps (see ``sync.apply.stage_update``)."""
        if isinstance(update, FullWeights):
            return False
        if self.opts.device.type == "cuda" and self._stage_stream is None:
            self._stage_stream = torch.cuda.Stream(self.opts.device)
        return self._on_update_tensors(lambda u: stage_update(self._update_targets(u), u), update,
                                       self._stage_stream)

    def _on_update_tensors(self, fn: Callable[[EngineUpdate], R], update: EngineUpdate,
                           stream: torch.cuda.Stream | None = None) -> R:
        """``fn(update)`` on the engine's stream, or on ``stream`` (which then waits for nothing
        of the engine's: a decode step in flight runs on beside it)."""
        if self.opts.device.type != "cuda":
            return fn(update)
        stream = stream or torch.cuda.current_stream()
        # the update's tensors were written on other threads' (default) streams
        stream.wait_stream(torch.cuda.default_stream(self.opts.device))
        try:
            with torch.cuda.stream(stream):
                return fn(update)
        finally:  # the sender may free or reuse its tensors once this returns
            stream.synchronize()

    def _apply_update(self, update: object) -> int:
        self._set_version(self._apply_weights(update))
        self._preempt_all()  # their KV was computed with the old weights
        return self.version

    def _set_version(self, version: int) -> None:
        """The weights' version from now on: the tokens each request samples after it carry it."""
        if version != self.version:
            for s in (*self.running, *self.waiting):
                if s.finish is None:
                    s.version_marks.append((self._num_generated(s), version))
        self.version = version

    def _apply_weights(self, update: object) -> int:
        """Write ``update`` into the weights; the version it brings. The store may refuse it
        before, or refit what the forward reads after (FP8: ``actors.engines.fp8_store``); a
        refusal raises, and the version stays."""
        self.weights.check_update(update)
        if isinstance(update, FullWeights):
            self.weights.load_full(update.tensors)
            version = int(update.version)
        else:
            version = apply_update(self._update_targets(update), update, self.version)
        self.weights.refit(update)
        return version

    def _update_targets(self, update: EngineUpdate) -> dict[str, torch.Tensor]:
        """The HF-named tensors ``sync.apply`` writes into (a tied head: see ``update_targets``)."""
        return update_targets(self.weights.params, update, tied=self.cfg.tie_word_embeddings)

    def _cmd_reset_prefix_cache(self) -> None:
        # No prefix cache is kept across requests; running requests' KV is their own.
        return None

    def _cmd_close(self) -> None:
        events = [self._end(s, "abort") for s in (*self.running, *self.waiting) if s.finish is None]
        self.running, self.waiting, self._ended = [], deque(), []
        self.closed = True
        if events:
            self._post(events, [])
