"""Decode steps replayed as CUDA graphs, one per batch-size bucket.

A decode step of a 0.5B model is ~200 small kernels; launched one by one
from Python it costs milliseconds of CPU time while the GPU idles. Captured
once per bucket and replayed, a step is one launch. The graph reads its
inputs from static buffers (tokens, positions) and the weights / KV cache
tensors it was captured with: weight updates write in place (same
addresses). The engine captures every bucket when it starts
(:meth:`capture_all`), so no capture (nor a Triton compile of a new batch
size) lands inside a run's steps; ``sleep`` frees those tensors, so
:meth:`reset` drops the graphs and they are re-captured lazily, each on its
bucket's next decode.

Capturing writes a throw-away key/value at position ``max_len - 1`` of the
bucket's slots: a running request only attends to positions it has already
written in the same step, so that value is never read.
"""

from __future__ import annotations

import torch

from actors.engines.model import Model


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (padding waste < 16 rows)."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    out += list(range(16, max_batch, 16))
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, model: Model, max_batch: int, device: torch.device):
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def reset(self) -> None:
        self._graphs.clear()
        self._pool = None

    def capture_all(self, weights, kv) -> None:
        """Capture every bucket's graph not captured yet."""
        for b in self.buckets:
            if b not in self._graphs:
                self._capture(weights, kv, b)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def decode(self, weights, kv, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Same contract as :meth:`Model.decode`; rows past ``n`` are padding."""
        n = tokens.shape[0]
        b = self.bucket(n)
        if b not in self._graphs:
            self._capture(weights, kv, b)
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if b > n:
            self.tokens[n:b].zero_()
            self.positions[n:b].zero_()
        graph, logits = self._graphs[b]
        graph.replay()
        return logits[:n]

    def _capture(self, weights, kv, b: int) -> None:
        self.tokens[:b].zero_()
        self.positions[:b].fill_(kv.max_len - 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: lazy cuBLAS / allocator init outside the capture
            self.model.decode(weights, kv, self.tokens[:b], self.positions[:b])
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a trainer on another thread of this process may use the GPU meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self.model.decode(weights, kv, self.tokens[:b], self.positions[:b])
        self._graphs[b] = (graph, logits)
