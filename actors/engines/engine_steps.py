"""What one turn of the torch engine's thread runs on the data path: admit
waiting requests, prefill them in batches, and run one decode step for every
running request, overlapped with the next turn on CUDA.

    waiting ──admit (batched)──► prefill chunks ──► running[slot] ──decode step──► table[slot]
                                                       ▲                  │           │ (one ends)
                                                       └─── compact ◄─────┘           ▼ events
    (overlap, CUDA: step k+1 is launched before step k's tokens are read back)

With overlap the chain of steps launched from the device's own tokens is
kept across ends: a request that stops or reaches its length stays in the
batch as an idle row (its later tokens are discarded, never delivered or
counted) until the chain has to be rebuilt anyway (admission, a command) or
idle rows exceed ``max(IDLE_ROWS_MIN, n // IDLE_ROWS_DIVISOR)`` of ``n``
rows; then one compaction drops them all (``timing["num_chain_breaks"]``).

:class:`Scheduler` is the half of :class:`~actors.engines.engine_core.EngineCore`
that touches the model; the other half takes the loop's commands. Both run on
the engine's one thread only.

The host's work per decode step does not loop over the running requests:
their state is a slot-indexed table (:class:`~actors.engines.kv_cache.SlotTable`:
sampling parameters, lengths, sampled tokens) that a step writes as one
block, and that a change of the running set slices (``running`` is replaced,
never changed in place; what its steps share, a :class:`_Batch`, is built
once per set). Stop tokens are found with one set test, length ends from a
deadline known ahead, compaction touches only what ended and what moves.
Python objects of requests are touched when they are admitted, end, move or
are preempted. A request's tokens go to the loop when it ends (one event
with all of them), or every step when it is streamed: a turn that ends
nothing posts nothing, and the loop's thread is not woken.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from actors.engines.cuda_graphs import DecodeGraphs
from actors.engines.kv_cache import KVCache, SlotTable
from actors.engines.model import Model
from actors.engines.sampling import SamplingBatch, sample
from actors.engines.weights import WeightStore
from contracts.rollout import SamplingParams

ADMIT_DELAY_STEPS = 4  # most decode steps a waiting request is held back to batch its prefill
PREFILL_PAD = 16  # CUDA prefill pads prompts to a multiple of this many tokens
# Idle rows (ended, still in the overlapped chain) a batch of n rows carries before the
# chain is broken to drop them: each costs a row of decode compute per step, a break costs
# the device an idle gap while the host reads back, compacts and relaunches.
IDLE_ROWS_MIN = 2
IDLE_ROWS_DIVISOR = 8

# What a stream gets: (stream, token ids, logprobs, raw logprobs, versions, finish_reason | None,
# error | None); the lists extend its output (all the request's tokens when it ends, one
# step's when it is streamed), then it ends with the finish reason or fails with the error.
Event = tuple[object, list[int], list[float], list[float], list[int], str | None, BaseException | None]


@dataclass(eq=False)
class Seq:
    """Engine-thread state of one request. While it runs, what it samples is in
    the engine's :class:`SlotTable` (at its slot); ``tokens`` / ``logprobs``
    take it in when it is preempted."""

    request_id: str
    stream: object  # loop-side sink, opaque here
    tokens: list[int]  # prompt + generated before its last admission (what a prefill reads)
    max_tokens: int
    sampling: SamplingParams
    seed: int
    streamed: bool = False  # its tokens go to the loop every step, not only when it ends
    slot: int = -1
    finish: str | None = field(default=None)
    # set on submit: the prompt's length, the position of the last token it may sample
    # (max_tokens, max_model_len), and (tokens generated before, version) at each version change
    num_prompt: int = 0
    last_pos: int = 0
    first: int = 0  # while in a slot: its table column of the first token (SlotTable)
    version_marks: list[tuple[int, int]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of tokens[num_prompt:]
    raw_logprobs: list[float] = field(default_factory=list)


@dataclass(eq=False)
class _Batch:
    """What the steps of one set of requests share: the running set (``seqs``
    is that list, compared by identity; ``slots`` None: slots 0..n-1) or a
    prefill chunk. Built with every earlier step of its requests read back."""

    seqs: list[Seq]
    slots: torch.Tensor | None  # [n] on the host
    params: SamplingBatch
    any_streamed: bool
    first_end: int  # index of the first step at which some row reaches its length limit
    num_steps: int = 0  # steps launched with it
    # the next step's inputs on the device (tokens [n], positions [n]); None: from the table
    next: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(eq=False)
class _Step:
    """A step whose tokens are on their way to the host."""

    batch: _Batch
    index: int  # among the batch's steps: at >= batch.first_end some row ends by length
    host: torch.Tensor  # [3, n] float32 (float64 past 2**24 ids): token, logprob, raw logprob
    done: torch.cuda.Event | None  # CPU: already there


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
    mtp_layers: int = 0  # MTP modules the weights hold (model.mtp_layers)
    speculative: bool = False  # decode turns draft with them (actors/engines/speculative.py)
    weight_dtype: str = "auto"  # "fp8": FP8 linears (actors.engines.fp8_store); "auto": ``dtype``
    fp8_skip: tuple[str, ...] = ()  # with fp8: the linears kept in ``dtype`` (substrings of HF names)

    def __post_init__(self) -> None:
        if self.overlap_steps is None:
            self.overlap_steps = self.device.type == "cuda"


class Scheduler:
    """Admission, batched prefill and (overlapped) decode steps over the running
    set. The state it reads is :class:`~actors.engines.engine_core.EngineCore`'s
    (set there, at construction and by its ``init`` command)."""

    opts: EngineOptions
    version: int
    running: list[Seq]  # running[i].slot == i; replaced, never changed in place
    waiting: deque[Seq]
    num_preemptions: int
    num_generated_tokens: int  # tokens sampled for requests, ever (not those of ended, idle rows)
    timing: dict[str, float]
    weights: WeightStore
    model: Model
    kv: KVCache
    table: SlotTable
    graphs: DecodeGraphs | None
    _post: Callable[[list[Event], list[Callable[[], None]]], None]
    _inflight: _Step | None
    _admit_wait: int
    _batch: _Batch | None
    _ended: list[Seq]  # running requests ended since the last compaction: idle rows of the batch
    _stop_ids: set[int]  # every stop token of a request ever admitted (a superset of the running ones')
    _stop_tensor: torch.Tensor  # the same, [k] on the host
    _readback_dtype: torch.dtype
    _noise: torch.Generator
    _pinned: list[torch.Tensor]
    _pinned_turn: int

    # ---- requests' state -------------------------------------------------------------------
    def _take_in(self, s: Seq) -> None:
        """Move what ``s`` sampled from its slot into ``s`` (it leaves its slot)."""
        tokens, lps, raws = self.table.read(s.slot, s.first)
        s.tokens += tokens
        s.logprobs += lps
        s.raw_logprobs += raws
        s.slot = -1

    def _num_generated(self, s: Seq) -> int:
        return len(s.tokens) + (self.table.num_steps - s.first if s.slot >= 0 else 0) - s.num_prompt

    def _end(self, s: Seq, finish: str | None, error: BaseException | None = None) -> Event:
        """The event that ends ``s``: all its tokens, unless they were streamed (or it failed)."""
        if s.streamed or error is not None:
            return (s.stream, [], [], [], [], finish, error)
        tokens, lps, raws = s.tokens[s.num_prompt:], s.logprobs, s.raw_logprobs
        if s.slot >= 0:
            more = self.table.read(s.slot, s.first)
            tokens, lps, raws = tokens + more[0], lps + more[1], raws + more[2]
        marks = s.version_marks
        versions: list[int] = []
        for i, (start, version) in enumerate(marks):
            end = marks[i + 1][0] if i + 1 < len(marks) else len(tokens)
            versions += [version] * (end - start)
        return (s.stream, tokens, lps, raws, versions, finish, None)

    def _preempt_all(self) -> None:
        """Running requests go back to the head of the queue, tokens kept, KV dropped."""
        self.num_preemptions += len(self.running) - len(self._ended)
        for s in reversed(self.running):
            if s.finish is None:
                self._take_in(s)
                self.waiting.appendleft(s)
            else:  # ended: its slot's KV is dropped with the rest
                s.slot = -1
        self.running, self._ended = [], []

    def _end_running(self, s: Seq, finish: str) -> None:
        s.finish = finish
        self._ended.append(s)

    def _compact(self) -> None:
        """Drop finished requests and move the survivors above the new end, in
        slot order, into the holes below it, in slot order."""
        if not self._ended:
            return
        running = self.running
        n = len(running) - len(self._ended)
        holes = sorted(s.slot for s in self._ended if s.slot < n)
        movers = [s for s in running[n:] if s.finish is None]  # as many as holes
        for s in self._ended:
            s.slot = -1
        self._ended = []
        alive = running[:n]
        if movers:
            srcs = [s.slot for s in movers]
            num_steps = self.table.num_steps  # the KV holds all of a request's tokens but its last:
            self.kv.move([(s.slot, dst, len(s.tokens) + num_steps - s.first - 1) for s, dst in zip(movers, holes)])
            self.table.move(srcs, holes)
            for s, dst in zip(movers, holes):
                s.slot = dst
                alive[dst] = s
        self.running = alive

    # ---- a turn ------------------------------------------------------------------------------
    def _admit_now(self) -> bool:
        """Whether waiting requests are prefilled this turn. A prefill costs the
        host about the same for one request as for many, and requests of a
        group arrive one by one, so while others are decoding, newcomers wait
        until there are enough to fill a quarter of the slots (or every free
        slot), or ``ADMIT_DELAY_STEPS`` decode steps have passed. (On CUDA each
        admission also ends the chain of overlapped steps: one wait for the
        device per prefill batch.)"""
        free = self.opts.max_num_seqs - (len(self.running) - len(self._ended))  # idle rows' slots are free
        if not self.waiting or free <= 0:
            self._admit_wait = 0
            return False
        self._admit_wait += 1
        return (not self.running or len(self.waiting) >= min(free, max(1, self.opts.max_num_seqs // 4))
                or self._admit_wait > ADMIT_DELAY_STEPS)

    def _step(self) -> None:
        events: list[Event] = []
        try:
            self._turn(events)
        except BaseException:  # requests this turn ended get their ends; the rest fail (_fail_all)
            if events:
                self._post(events, [])
            raise
        if events:
            self._post(events, [])

    def _turn(self, events: list[Event]) -> None:
        t0 = time.perf_counter()
        admit: list[Seq] = []
        if self._admit_now():
            self._admit_wait = 0
            num_live = len(self.running) - len(self._ended)
            while self.waiting and num_live + len(admit) < self.opts.max_num_seqs:
                admit.append(self.waiting.popleft())
        if admit:
            self._drain(events)  # the batch changes: finish the step in flight first
            self._compact()  # idle rows leave before the newcomers take slots n..
            t1 = time.perf_counter()
            self.timing["num_prefills"] += 1
            self.timing["num_prefill_seqs"] += len(admit)
            self._prefill(admit, events)
            self._compact()
            self.timing["prefill_s"] += time.perf_counter() - t1
        if self.running:
            self._decode(events)
        timing = self.timing
        timing["num_turns"] += 1
        timing["turn_s"] += time.perf_counter() - t0

    def _prefill(self, seqs: list[Seq], events: list[Event]) -> None:
        device = self.opts.device
        n = len(self.running)
        for i, s in enumerate(seqs):
            s.slot = n + i
        sp = [s.sampling for s in seqs]
        first = self.table.admit(
            [s.slot for s in seqs], [len(s.tokens) for s in seqs], [s.last_pos for s in seqs],
            [[p.temperature for p in sp], [p.top_k for p in sp], [p.top_p for p in sp], [s.seed for s in seqs]],
            [[p.temperature <= 0 for p in sp], [p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) for p in sp],
             [p.temperature != 1.0 for p in sp], [p.seed is not None for p in sp], [s.streamed for s in seqs]])
        for s in seqs:
            s.first = first
        stop_ids = self._stop_ids.union(*(p.stop_token_ids for p in sp))
        if len(stop_ids) > len(self._stop_ids):
            self._stop_ids, self._stop_tensor = stop_ids, torch.tensor(sorted(stop_ids))
        self.running = self.running + seqs
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
        batch = self._make_batch(seqs, meta[0])  # its copy is queued ahead of the forward
        meta = meta.to(device, non_blocking=True)
        t0 = time.perf_counter()
        logits = self._prefill_logits(tokens, meta[0], meta[1])
        t1 = time.perf_counter()
        token, lp, raw = sample(logits, batch.params, meta[1] + 1)
        timing = self.timing
        timing["forward_s"] += t1 - t0
        timing["sample_s"] += time.perf_counter() - t1
        self._finish_decode(self._readback(batch, token, lp, raw), events, timed=False)

    def _prefill_logits(self, tokens: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.model.prefill(self.weights, self.kv, tokens, slots, last)

    def _drain(self, events: list[Event]) -> None:
        """Finish the decode step in flight, if any (before anything that
        reads or moves the running set: commands, admission, compaction)."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self.timing["num_chain_breaks"] += 1
            self._finish_decode(step, events)
            self._compact()

    def _decode(self, events: list[Event]) -> None:
        """One decode step for every running request.

        With ``overlap_steps`` the step is left in flight: the next turn
        launches step k+1 from step k's sampled tokens *on the device*, and
        only then reads step k's tokens back, so the host's bookkeeping and
        launches run while the GPU computes. A request that ends at step k
        (stop token or length) stays in the batch as an idle row: step k+1
        was computed for it and later steps are too, their tokens dropped,
        until the chain is rebuilt anyway or the idle rows pass the bound
        (``IDLE_ROWS_*``); then the step in flight is read back, idle rows
        are compacted out and the next step starts from the host's table
        (a chain break, counted). Seeded requests sample the same tokens
        either way; unseeded ones draw from the engine's generator over the
        whole batch, idle rows included, so their draws depend on when idle
        rows leave. Without overlap every step is read back and compacted
        at once; a step whose running set is the last step's starts from
        that step's tokens on the device all the same (no host copy)."""
        prev, self._inflight = self._inflight, None
        n, num_idle = len(self.running), len(self._ended)
        chain = (prev is not None and prev.batch.seqs is self.running and num_idle < n
                 and num_idle <= max(IDLE_ROWS_MIN, n // IDLE_ROWS_DIVISOR))
        if prev is not None and not chain:
            self.timing["num_chain_breaks"] += 1
            self._finish_decode(prev, events)
            self._compact()
            if not self.running:
                return
        step = self._launch_decode()
        if chain:
            self._finish_decode(prev, events)  # requests it ends stay in the batch, idle, for `step`
        if self.opts.overlap_steps:
            self._inflight = step
        else:
            self._finish_decode(step, events)
            self._compact()

    def _batch_for(self, seqs: list[Seq]) -> _Batch:
        """The running set's :class:`_Batch`, built on its first step."""
        batch = self._batch
        if batch is None or batch.seqs is not seqs:
            batch = self._batch = self._make_batch(seqs, None)
        return batch

    def _make_batch(self, seqs: list[Seq], slots: torch.Tensor | None) -> _Batch:
        """Sampling tensors from the table's rows: one non-blocking copy (a
        blocking one would wait for the step in flight on the engine's stream)."""
        t = self.table
        index = slice(0, len(seqs)) if slots is None else slots
        rows = t.params[:, index].to(self.opts.device, non_blocking=True)  # [4, n]
        greedy, filtered, not_unit, seeded, streamed = t.flags[:, index].any(1).tolist()
        params = SamplingBatch(
            temperature=rows[0].float(),
            top_k=rows[1].long(),
            top_p=rows[2].float(),
            seed=rows[3].long(),
            needs_filter=filtered,
            any_greedy=greedy,
            unit_temperature=not not_unit,
            generator=None if seeded else self._noise,
        )
        return _Batch(seqs, slots, params, streamed, int(t.deadline[index].min()) - t.num_steps)

    def _launch_decode(self) -> _Step:
        """Launch a decode step of the running set (left for :meth:`_finish_decode`)."""
        t0 = time.perf_counter()
        batch = self._batch_for(self.running)
        if batch.next is None:  # each row's last token (every one sampled in the last column) and position
            n, t = len(batch.seqs), self.table
            tokens = t.values[0, (t.num_steps - 1) % t.ring, :n].to(torch.int64)
            meta = torch.stack([tokens, t.length(slice(0, n)) - 1]).to(self.opts.device, non_blocking=True)
            tokens, positions = meta[0], meta[1]
        else:
            tokens, positions = batch.next
            if self._ended:  # idle rows run on past their ends: keep them inside the cache and rotary table
                positions = positions.clamp(max=self.kv.max_len - 1)
        t1 = time.perf_counter()
        if self.graphs is not None:
            logits = self.graphs.decode(self.weights, self.kv, tokens, positions)
        else:
            logits = self.model.decode(self.weights, self.kv, tokens, positions)
        t2 = time.perf_counter()
        positions = positions + 1  # of the sampled tokens: the next step's input positions
        token, lp, raw = sample(logits, batch.params, positions)
        t3 = time.perf_counter()
        batch.next = (token, positions)
        step = self._readback(batch, token, lp, raw)
        timing = self.timing
        timing["num_decode_steps"] += 1
        timing["forward_s"] += t2 - t1
        timing["sample_s"] += t3 - t2
        timing["decode_launch_s"] += time.perf_counter() - t0
        return step

    def _readback(self, batch: _Batch, token: torch.Tensor, lp: torch.Tensor, raw: torch.Tensor) -> _Step:
        """Start the one device->host copy of a step's tokens and log-probs
        (the log-probs are float32; float32 holds token ids below 2**24 exactly)."""
        dtype = self._readback_dtype
        stacked = torch.stack([token.to(dtype), lp.to(dtype), raw.to(dtype)])
        index = batch.num_steps
        batch.num_steps += 1
        if stacked.device.type != "cuda":
            return _Step(batch, index, stacked, None)
        self._pinned_turn ^= 1
        host = self._pinned[self._pinned_turn].view(dtype)[: stacked.numel()].view(stacked.shape)
        host.copy_(stacked, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _Step(batch, index, host, done)

    def _finish_decode(self, step: _Step, events: list[Event], timed: bool = True) -> int:
        """Write a step's tokens into the table, end the requests it ended
        (their events into ``events``) and stream what is streamed; returns
        how many requests it ended."""
        t1 = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        t2 = time.perf_counter()
        batch, host, t = step.batch, step.host, self.table
        seqs = batch.seqs
        if batch.slots is None:
            t.write_step(host)  # the rows of requests that ended meanwhile too: their columns are not read again
            slots: torch.Tensor | slice = slice(0, len(seqs))
        else:
            t.write_prefill(batch.slots, host)
            slots = batch.slots
        # idle rows: requests of the running set that ended at an earlier step (a prefill's rows
        # are new); their tokens here are past their ends
        dropped = {s.slot for s in self._ended} if batch.slots is None and self._ended else set()
        ended: dict[int, str] = {}  # row -> finish reason
        if step.index >= batch.first_end:  # some row sampled at its last position
            ended = {i: "length" for i in (t.deadline[slots] < t.num_steps).nonzero()[:, 0].tolist()}
        if self._stop_ids and not self._stop_ids.isdisjoint(host[0].tolist()):  # floats: equal, hash equal
            for i in torch.isin(host[0], self._stop_tensor.to(host.dtype)).nonzero()[:, 0].tolist():
                if int(host[0, i]) in seqs[i].sampling.stop_token_ids:
                    ended[i] = "stop"  # a stop wins over the length limit
        if dropped:
            ended = {i: reason for i, reason in ended.items() if seqs[i].slot not in dropped}
        self.num_generated_tokens += len(seqs) - len(dropped)
        if batch.any_streamed:
            version = self.version
            values = host.tolist()
            events += [(s.stream, [int(values[0][i])], [values[1][i]], [values[2][i]], [version], ended.get(i), None)
                       for i, s in enumerate(seqs) if s.streamed and s.slot not in dropped]
        for i, reason in ended.items():
            s = seqs[i]
            self._end_running(s, reason)
            if not s.streamed:
                events.append(self._end(s, reason))
        if timed:
            timing = self.timing
            timing["decode_wait_s"] += t2 - t1
            timing["decode_post_s"] += time.perf_counter() - t2
        self.timing["device_wait_s"] += t2 - t1
        return len(ended)

    def _fail_all(self, exc: BaseException) -> None:
        self._inflight = None
        events = [self._end(s, None, exc) for s in (*self.running, *self.waiting) if s.finish is None]
        self.running, self.waiting, self._ended = [], deque(), []
        if events:
            self._post(events, [])
