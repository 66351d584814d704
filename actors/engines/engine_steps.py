"""What one turn of the torch engine's thread runs on the data path: admit
waiting requests, prefill them in batches, and run one decode step for every
running request, overlapped with the next turn on CUDA.

    waiting ──admit (batched)──► prefill chunks ──► running[slot] ──decode step──► tokens ─► events
                                                       ▲                  │
                                                       └─── compact ◄─────┘
    (overlap, CUDA: step k+1 is launched before step k's tokens are read back)

:class:`Scheduler` is the half of :class:`~actors.engines.engine_core.EngineCore`
that touches the model; the other half takes the loop's commands. Both run on
the engine's one thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.engines.cuda_graphs import DecodeGraphs
from actors.engines.kv_cache import KVCache
from actors.engines.model import Model
from actors.engines.sampling import SamplingBatch, sample
from actors.engines.weights import WeightStore
from contracts.rollout import SamplingParams

ADMIT_DELAY_STEPS = 4  # most decode steps a waiting request is held back to batch its prefill
PREFILL_PAD = 16  # CUDA prefill pads prompts to a multiple of this many tokens

# (stream, token | None, logprob, raw_logprob, version, finish_reason | None, error | None)
Event = tuple[Any, int | None, float, float, int, str | None, BaseException | None]


@dataclass(eq=False)
class Seq:
    """Engine-thread state of one request."""

    request_id: str
    stream: Any  # loop-side sink, opaque here
    tokens: list[int]  # prompt + generated; the last one is not in the KV cache yet while running
    max_tokens: int
    sampling: SamplingParams
    seed: int
    num_generated: int = 0
    slot: int = -1
    finish: str | None = field(default=None)


@dataclass(eq=False)
class _Step:
    """A decode step whose tokens are on their way to the host."""

    seqs: list[Seq]
    tokens: torch.Tensor  # sampled, on the device: the next step's input when chained
    host: torch.Tensor  # [3, n] float64: token, logprob, raw logprob
    done: Any  # torch.cuda.Event | None (CPU: already there)
    positions: torch.Tensor | None = None


@dataclass
class EngineOptions:
    model_path: str
    device: torch.device
    dtype: torch.dtype
    max_num_seqs: int
    max_model_len: int
    seed: int
    cuda_graphs: bool
    max_prefill_tokens: int
    compile_decode: bool | str
    overlap_steps: bool | None = None  # None: on for CUDA (see Scheduler._decode)

    def __post_init__(self) -> None:
        if self.overlap_steps is None:
            self.overlap_steps = self.device.type == "cuda"


class Scheduler:
    """Admission, batched prefill and (overlapped) decode steps over the running
    set. The state it reads is :class:`~actors.engines.engine_core.EngineCore`'s
    (set there, at construction and by its ``init`` command)."""

    opts: EngineOptions
    version: int
    running: list[Seq]  # running[i].slot == i
    waiting: deque[Seq]
    num_preemptions: int
    timing: dict[str, float]
    weights: WeightStore
    model: Model
    kv: KVCache
    graphs: DecodeGraphs | None
    _post: Callable[[list[Event], list[Callable[[], None]]], None]
    _inflight: _Step | None
    _admit_wait: int
    _params_cache: tuple[tuple[int, ...], SamplingBatch] | None
    _noise: torch.Generator
    _pinned: list[torch.Tensor]
    _pinned_turn: int

    def _preempt_all(self) -> None:
        """Running requests go back to the head of the queue, tokens kept, KV dropped."""
        self.num_preemptions += len(self.running)
        for s in reversed(self.running):
            s.slot = -1
            self.waiting.appendleft(s)
        self.running = []

    def _compact(self) -> None:
        """Drop finished requests and move survivors into the holes below them."""
        alive = [s for s in self.running if s.finish is None]
        n = len(alive)
        holes = iter(sorted(set(range(n)) - {s.slot for s in alive}))
        for s in alive:
            if s.slot >= n:
                dst = next(holes)
                self.kv.move(s.slot, dst, len(s.tokens) - 1)
                s.slot = dst
        alive.sort(key=lambda s: s.slot)
        self.running = alive

    def _admit_now(self) -> bool:
        """Whether waiting requests are prefilled this turn. A prefill costs the
        host about the same for one request as for many, and requests of a
        group arrive one by one, so while others are decoding, newcomers wait
        until there are enough to fill a quarter of the slots (or every free
        slot), or ``ADMIT_DELAY_STEPS`` decode steps have passed."""
        free = self.opts.max_num_seqs - len(self.running)
        if not self.waiting or free <= 0:
            self._admit_wait = 0
            return False
        self._admit_wait += 1
        return (not self.running or len(self.waiting) >= min(free, max(1, self.opts.max_num_seqs // 4))
                or self._admit_wait > ADMIT_DELAY_STEPS)

    def _step(self) -> None:
        events: list[Event] = []
        admit: list[Seq] = []
        if self._admit_now():
            self._admit_wait = 0
            while self.waiting and len(self.running) + len(admit) < self.opts.max_num_seqs:
                admit.append(self.waiting.popleft())
        if admit:
            self._drain(events)  # the batch changes: finish the step in flight first
            t0 = time.perf_counter()
            self.timing["num_prefills"] += 1
            self.timing["num_prefill_seqs"] += len(admit)
            self._prefill(admit, events)
            self._compact()
            self.timing["prefill_s"] += time.perf_counter() - t0
        if self.running:
            self._decode(events)
        self._post(events, [])

    def _prefill(self, seqs: list[Seq], events: list[Event]) -> None:
        device = self.opts.device
        for s in seqs:
            s.slot = len(self.running)
            self.running.append(s)
        chunk: list[Seq] = []
        for s in sorted(seqs, key=lambda s: len(s.tokens)):
            longest = len(s.tokens)  # sorted: the newcomer is the longest of the chunk
            if chunk and longest * (len(chunk) + 1) > self.opts.max_prefill_tokens:
                self._prefill_chunk(chunk, events, device)
                chunk = []
            chunk.append(s)
        if chunk:
            self._prefill_chunk(chunk, events, device)

    def _prefill_chunk(self, seqs: list[Seq], events: list[Event], device: torch.device) -> None:
        T = max(len(s.tokens) for s in seqs)
        if device.type == "cuda":  # few distinct shapes: attention plans and allocator blocks get reused
            T = min(-(-T // PREFILL_PAD) * PREFILL_PAD, self.model.cos.shape[0])
        rows = [s.tokens + [0] * (T - len(s.tokens)) for s in seqs]
        tokens = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        meta = torch.tensor([[s.slot for s in seqs], [len(s.tokens) - 1 for s in seqs]], dtype=torch.int64)
        meta = meta.to(device, non_blocking=True)
        logits = self.model.prefill(self.weights, self.kv, tokens, meta[0], meta[1])
        self._sample(seqs, logits, meta[1] + 1, events)

    def _drain(self, events: list[Event]) -> None:
        """Finish the decode step in flight, if any (before anything that
        reads or moves the running set: commands, admission, compaction)."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._finish_decode(step, events)
            self._compact()

    def _decode(self, events: list[Event]) -> None:
        """One decode step for every running request.

        With ``overlap_steps`` the step is left in flight: the next turn
        launches step k+1 from step k's sampled tokens *on the device*, and
        only then reads step k's tokens back, so the host's bookkeeping and
        launches run while the GPU computes. A request that stops (stop
        token) at step k has had step k+1 computed for it; that token is
        dropped. Whenever the running set would change, the chain ends."""
        prev, self._inflight = self._inflight, None
        max_len = self.opts.max_model_len
        chain = prev is not None and prev.seqs == self.running and all(
            s.num_generated + 1 < s.max_tokens and len(s.tokens) + 1 < max_len for s in prev.seqs)
        if prev is not None and not chain:
            self._finish_decode(prev, events)
            self._compact()
            if not self.running:
                return
        seqs = list(self.running)
        if chain:
            step = self._launch_decode(seqs, prev.tokens, prev.positions + 1)
            self._finish_decode(prev, events)
            if any(s.finish is not None for s in seqs):  # stopped: the running set changes
                self._finish_decode(step, events)
                self._compact()
                return
        else:
            meta = torch.tensor([[s.tokens[-1] for s in seqs], [len(s.tokens) - 1 for s in seqs]], dtype=torch.int64)
            meta = meta.to(self.opts.device, non_blocking=True)
            step = self._launch_decode(seqs, meta[0], meta[1])
        if self.opts.overlap_steps:
            self._inflight = step
        else:
            self._finish_decode(step, events)
            self._compact()

    def _launch_decode(self, seqs: list[Seq], tokens: torch.Tensor, positions: torch.Tensor) -> _Step:
        t0 = time.perf_counter()
        self.timing["num_decode_steps"] += 1
        if self.graphs is not None:
            logits = self.graphs.decode(self.weights, self.kv, tokens, positions)
        else:
            logits = self.model.decode(self.weights, self.kv, tokens, positions)
        token, lp, raw = sample(logits, self._sampling_batch(seqs), positions + 1)
        step = self._readback(seqs, token, lp, raw)
        step.positions = positions
        self.timing["decode_launch_s"] += time.perf_counter() - t0
        return step

    def _readback(self, seqs: list[Seq], token: torch.Tensor, lp: torch.Tensor, raw: torch.Tensor) -> _Step:
        """Start the one device->host copy of a step's tokens and log-probs
        (float64 holds token ids exactly)."""
        stacked = torch.stack([token.double(), lp.double(), raw.double()])
        if stacked.device.type != "cuda":
            return _Step(seqs, token, stacked, None)
        self._pinned_turn ^= 1
        host = self._pinned[self._pinned_turn][: stacked.numel()].view(stacked.shape)
        host.copy_(stacked, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _Step(seqs, token, host, done)

    def _finish_decode(self, step: _Step, events: list[Event], timed: bool = True) -> None:
        t1 = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        token_l, lp_l, raw_l = step.host.tolist()
        t2 = time.perf_counter()
        self._append(step.seqs, token_l, lp_l, raw_l, events)
        if timed:
            self.timing["decode_wait_s"] += t2 - t1
            self.timing["decode_post_s"] += time.perf_counter() - t2

    def _sampling_batch(self, seqs: list[Seq]) -> SamplingBatch:
        key = tuple(id(s) for s in seqs)
        if self._params_cache is not None and self._params_cache[0] == key:
            return self._params_cache[1]
        device = self.opts.device
        sp = [s.sampling for s in seqs]
        batch = SamplingBatch(
            temperature=torch.tensor([p.temperature for p in sp], dtype=torch.float32).to(device),
            top_k=torch.tensor([p.top_k for p in sp], dtype=torch.int64).to(device),
            top_p=torch.tensor([p.top_p for p in sp], dtype=torch.float32).to(device),
            seed=torch.tensor([s.seed for s in seqs], dtype=torch.int64).to(device),
            needs_filter=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) for p in sp),
            any_greedy=any(p.temperature <= 0 for p in sp),
            unit_temperature=all(p.temperature == 1.0 for p in sp),
            generator=None if any(p.seed is not None for p in sp) else self._noise,
        )
        self._params_cache = (key, batch)
        return batch

    def _sample(self, seqs: list[Seq], logits: torch.Tensor, positions: torch.Tensor, events: list[Event]) -> None:
        """Sample the next token of ``seqs`` and append it now (prefill)."""
        step = self._readback(seqs, *sample(logits, self._sampling_batch(seqs), positions))
        self._finish_decode(step, events, timed=False)

    def _append(self, seqs: list[Seq], token_l: list, lp_l: list, raw_l: list, events: list[Event]) -> None:
        max_len = self.opts.max_model_len
        for s, t, a, b in zip(seqs, token_l, lp_l, raw_l):
            if s.finish is not None:  # stopped (or aborted) while this step was in flight
                continue
            t = int(t)
            s.tokens.append(t)
            s.num_generated += 1
            if t in s.sampling.stop_token_ids:
                s.finish = "stop"
            elif s.num_generated >= s.max_tokens or len(s.tokens) >= max_len:
                s.finish = "length"
            events.append((s.stream, t, a, b, self.version, s.finish, None))

    def _fail_all(self, exc: BaseException) -> None:
        self._inflight = None
        events = [(s.stream, None, 0.0, 0.0, self.version, None, exc) for s in (*self.running, *self.waiting)]
        self.running, self.waiting = [], deque()
        self._post(events, [])
