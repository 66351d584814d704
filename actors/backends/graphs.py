"""``trainer.cuda_graphs``: the torch backend's packed forward and backward replayed as CUDA graphs.

A small model's step is bound by the host that launches its kernels, not by the device
that runs them: SmolLM2-135M, 64 x ~200-token samples, eager, launches ~4,500 kernels a
step and leaves the device idle for about half of it. Captured once, a forward and its
backward are each one launch.

A graph runs fixed shapes, so each micro-batch is padded to a *bucket*:

    samples ─► packed_batch(pad_to=(N_b, S_b)): the tokens rounded up to a multiple of
               BUCKET_TOKENS with pad sequences of at most PAD_PIECE tokens, the sequences
               to S_b with empty ones (cu_seqlens repeats its end), the longest sequence
               to a power of two of at least 1024 (L_b, the varlen kernel's bound)
            ─► one graph pair per (N_b, S_b, L_b), captured when first needed (below):
               forward   ids, positions, cu_seqlens ─► the model ─► [N_b, 2] (log-prob of
                         the next token, entropy) at every position; the LM head in chunks
               backward  d(loss)/d[N_b, 2] ─► the model's gradients, added into grad
                         buffers that stay the same tensors (attach_grads)
            ─► the response positions' rows picked out (index_select) for the loss, which
               runs eagerly between the two

A bucket already captured that holds a micro-batch serves it (its padding then in larger
pieces), the smallest such, until the tokens padded beyond the micro-batch's own bucket add
up to CAPTURE_COST_TOKENS; then its own is captured (ski rental). A capture costs two eager
passes and the capture itself, a replay a small share of one eager pass: a size that recurs
earns its graphs, one met now and then is padded. Under ``trainer.micro_batch_tokens`` a
step's last micro-batch holds what is left over, one sample to the budget: before this, its
sizes captured 1-3 buckets in each 10-step window of the SmolLM2-135M bench
(docs/benchmarks.md).

Every graph shares one memory pool. That is safe because a forward's replay is followed by
its own backward's before any other graph replays (one micro-batch at a time), so what one
graph leaves in the pool is dead when the next writes it. The head runs on padding and
prompt positions too (~10% more head FLOPs for SmolLM2's step) so that the response count
is not a dimension of the bucket; S_b is the samples plus room for the pad pieces, rounded
to 32, so a run with a fixed batch meets few buckets (a handful of token counts).

Only the grad-enabled forward is graphed (training); log-probs without gradients (an
evaluation of the proximal policy) run eagerly. The varlen flash kernel must run the
attention: CUDA, bf16 or fp16, packed, one worker, no activation checkpointing and no
``trainer.compile`` (its packed attention reads the bounds on the host, which a graph
would freeze) -- :func:`graphs_unsupported` says which is missing.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch.autograd.function import FunctionCtx

from actors.backends.packing import PackedBatch, packed_batch, varlen_available
from contracts.sample import Sample

__all__ = ["BUCKET_TOKENS", "GraphedPasses", "bucket_shape", "graphs_unsupported", "pick_bucket"]

BUCKET_TOKENS = 2048  # a micro-batch's tokens are rounded up to a multiple of this
PAD_PIECE = 128  # the padding is split into sequences of at most this many tokens (in its own bucket)
CAPTURE_COST_TOKENS = 65536  # padded tokens a capture is worth (on the cautious side of ~100k)
MIN_MAX_LEN = 1024  # the least bound on the longest sequence a bucket has
_SEQ_ROUND = 32
_WARMUP = 2  # eager forward + backward passes before a capture (lazy inits, autotuning)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def bucket_shape(samples: list[Sample]) -> tuple[int, int]:
    """``(tokens, sequences)`` a micro-batch of ``samples`` is padded to."""
    n = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return _round_up(max(n, 1), BUCKET_TOKENS), _round_up(len(samples) + BUCKET_TOKENS // PAD_PIECE, _SEQ_ROUND)


def max_len_bound(max_len: int) -> int:
    """The varlen kernel's bound on a sequence's length in a bucket: a power of two, at least
    MIN_MAX_LEN (a longer bound than needed only adds blocks that exit at once; one bound for
    every row of up to 1024 tokens saves the captures a bound per power of two would cost)."""
    return 1 << (max(max_len, MIN_MAX_LEN) - 1).bit_length()


Bucket = tuple[int, int, int]  # (tokens N_b, sequences S_b, max_len bound L_b)


def own_bucket(samples: list[Sample]) -> Bucket:
    """The bucket ``samples`` are padded to when they get graphs of their own."""
    return (*bucket_shape(samples), max_len_bound(max(len(s.prompt_ids) + len(s.response_ids) for s in samples)))


def pick_bucket(samples: list[Sample], captured: Iterable[Bucket], wasted: Counter[Bucket],
                own: Bucket | None = None) -> tuple[Bucket, int]:
    """The bucket ``samples`` run in and the size of their pad pieces: their own bucket (``own``,
    computed when not given) when it is captured or has been padded past by
    ``CAPTURE_COST_TOKENS`` (``wasted`` counts the tokens beyond it, per own bucket), else the
    smallest captured one that holds them, else their own (to be captured)."""
    own = own_bucket(samples) if own is None else own
    if own in captured or wasted[own] >= CAPTURE_COST_TOKENS:
        return own, PAD_PIECE
    n = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    fits = []
    for key in captured:
        room, pad = key[1] - len(samples), key[0] - n
        if pad >= 0 and key[2] >= own[2] and room > 0:
            piece = max(PAD_PIECE, -(-pad // room))  # ceil(pad / room) pieces fit the room
            if piece <= key[2]:
                fits.append((key, piece))
    if not fits:
        return own, PAD_PIECE
    key, piece = min(fits)
    wasted[own] += key[0] - own[0]
    return key, piece


def graphs_unsupported(device: torch.device, dtype: torch.dtype, *, packed: bool, compile: bool,
                       activation_checkpointing: bool, world_size: int) -> str | None:
    """Why ``trainer.cuda_graphs`` cannot run with these settings (one line), or None."""
    if device.type != "cuda":
        return f"needs trainer.device=cuda (got {str(device)!r})"
    if dtype not in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        return f"needs trainer.dtype bfloat16 or float16 (the varlen flash attention), got {name}"
    if not varlen_available():
        return f"needs torch.nn.attention.varlen (torch >= 2.9), which torch {torch.__version__} lacks"
    if not packed:
        return "needs packed micro-batches (trainer.packed: true, on a model that packs)"
    if compile:
        return "not with trainer.compile (its packed attention reads sequence bounds on the host); choose one"
    if activation_checkpointing:
        return "not with trainer.activation_checkpointing"
    if world_size > 1:
        return f"one worker only (got {world_size} data-parallel ranks)"
    return None


class _Graph:
    """One bucket's captured forward and backward, and their static tensors."""

    def __init__(self, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        self.ids, self.positions, self.cu_seqlens = ids, positions, cu_seqlens
        self.forward = torch.cuda.CUDAGraph()
        self.backward = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None  # [N_b, 2], written by each forward replay
        self.grad: torch.Tensor | None = None  # [N_b, 2], read by each backward replay


class _Replay(torch.autograd.Function):
    """The forward graph's replay as an autograd node whose backward replays the backward graph
    (which adds into the attached grad buffers itself: no gradient flows out of it)."""

    @staticmethod
    def forward(ctx: FunctionCtx, anchor: torch.Tensor, graph: _Graph) -> torch.Tensor:
        graph.forward.replay()
        ctx.graph = graph
        return graph.out.clone()  # the next micro-batch's replay overwrites graph.out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, None]:
        graph = ctx.graph
        graph.grad.copy_(grad)
        graph.backward.replay()
        return None, None


#: The backend's packed forward: (batch, positions [T], targets [T], with_entropy) -> [T, 2].
PackedForward = Callable[[PackedBatch, torch.Tensor, torch.Tensor, bool], torch.Tensor]


class GraphedPasses:
    """The graphed training forward of one model (see the module doc). ``forward`` is the
    backend's packed forward; the model's parameters get persistent grad buffers."""

    def __init__(self, model: torch.nn.Module, forward: PackedForward, device: torch.device) -> None:
        self.model, self._forward, self.device = model, forward, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads: list[torch.Tensor] | None = None
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.capture_s = 0.0  # seconds spent warming up and capturing, all buckets
        self.reuses = 0  # micro-batches run in a bigger bucket than their own (pick_bucket)
        self._wasted: Counter[Bucket] = Counter()
        self._pool: tuple[int, int] | None = None  # the captured graphs' memory pool handle
        self._anchor = torch.zeros((), device=device, requires_grad=True)

    def attach_grads(self) -> None:
        """Zero the grad buffers and make them the params' ``.grad`` (the backward graphs add
        into these very tensors; an optimizer that lets ``.grad`` go loses nothing)."""
        if self.grads is None:
            self.grads = [torch.zeros_like(p) for p in self.params]
        else:
            torch._foreach_zero_(self.grads)
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def logprobs(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs, entropy and mask ``[B, T_max]`` of ``samples``' responses, as the eager
        packed forward gives them, through the bucket's graphs (captured on first use)."""
        own = own_bucket(samples)
        key, piece = pick_bucket(samples, self.graphs, self._wasted, own)
        batch = packed_batch(samples, self.device, pad_to=key[:2], pad_piece=piece)
        self.reuses += key != own
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(batch, key[2])
        else:
            graph.ids.copy_(batch.input_ids)
            graph.positions.copy_(batch.position_ids)
            graph.cu_seqlens.copy_(batch.cu_seqlens)
        out = _Replay.apply(self._anchor, graph).index_select(0, batch.pred_positions)  # [T, 2]
        logprobs, entropy = batch.scatter(out).unbind(-1)
        return logprobs, entropy, batch.mask

    def _run(self, graph: _Graph, max_len: int) -> torch.Tensor:
        """The model on the graph's static inputs: ``[N_b, 2]`` at every position."""
        ids = graph.ids[0]
        batch = PackedBatch(input_ids=graph.ids, position_ids=graph.positions, cu_seqlens=graph.cu_seqlens,
                            seq_bounds=(), max_len=max_len, pred_positions=torch.empty(0), targets=torch.empty(0),
                            resp_index=torch.empty(0), mask=torch.empty(0))
        everywhere = torch.arange(ids.shape[0], device=ids.device)
        return self._forward(batch, everywhere, torch.roll(ids, -1), True)

    def _capture(self, batch: PackedBatch, max_len: int) -> _Graph:
        # The params' AccumulateGrad nodes date from eager steps on the default stream, and
        # autograd warns (once a capture) that the side and capture streams differ from theirs:
        # a possible wait at capture time only, none in the replays.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
            return self._capture_quiet(batch, max_len)

    def _capture_quiet(self, batch: PackedBatch, max_len: int) -> _Graph:
        t0 = time.perf_counter()
        if self.grads is None:
            self.attach_grads()
        saved = [g.clone() for g in self.grads]  # this step's gradients so far (earlier micro-batches)
        graph = _Graph(batch.input_ids.clone(), batch.position_ids.clone(), batch.cu_seqlens.clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # lazy initialisations and autotuning, outside any capture
            for _ in range(_WARMUP):
                out = self._run(graph, max_len)
                out.backward(torch.ones_like(out))
            del out
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph.grad = torch.zeros(graph.ids.shape[1], 2, dtype=torch.float32, device=self.device)
        with torch.cuda.graph(graph.forward, pool=self._pool, capture_error_mode="thread_local"):
            graph.out = self._run(graph, max_len)
        self._pool = graph.forward.pool() if self._pool is None else self._pool
        with torch.cuda.graph(graph.backward, pool=self._pool, capture_error_mode="thread_local"):
            torch.autograd.backward(graph.out, graph.grad)
        torch._foreach_copy_(self.grads, saved)  # the warm-up passes' gradients, taken out again
        self.capture_s += time.perf_counter() - t0
        return graph
