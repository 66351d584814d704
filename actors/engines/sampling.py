"""Batched sampling with per-request temperature / top-k / top-p / seed.

The random draw is a Gumbel-max over counter-based noise: the noise of
vocabulary entry ``j`` for a request is a hash of (seed, position, j). So a
seeded request samples the same tokens whatever batch it shares, whichever
step it lands in, and after an abort-and-resume (the position continues).
No generator objects, no host round trips, one fixed set of kernels.
When no request of a batch is seeded the noise comes from one ``torch.rand``
(an engine-wide generator seeded once) instead: the hash costs ~10 int64
passes over [B, V], which is most of a decode step's sampling on a GPU. On
CUDA such a batch without top-k / top-p is sampled by one fused Triton kernel
(:func:`actors.engines.triton_kernels.sample_gumbel`), greedy rows (an
evaluation's, beside training) included.

Log-probs returned per sampled token:
  * ``raw``: log-softmax of the unmodified logits (T=1).
  * ``logprob``: log-softmax after temperature, top-k, top-p — the
    distribution the token was drawn from. Greedy (``temperature == 0``)
    uses the unmodified distribution, as vLLM does (a point mass would give 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engines import triton_kernels

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, tensors [B] on the logits' device."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32; 1.0 = off
    seed: torch.Tensor  # int64 in [0, 2**32); ignored when ``generator`` is set
    needs_filter: bool  # some row uses top-k or top-p (costs a sort over the vocabulary)
    any_greedy: bool = True  # some row has temperature 0
    unit_temperature: bool = False  # every row samples at T=1 unfiltered: logprob == raw
    generator: torch.Generator | None = None  # no row is seeded: draw noise from this (one fast kernel)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply); constants < 2**31 keep int64 products exact."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK32
    return x ^ (x >> 15)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] determined by (seed[b], position[b], j)."""
    row = _mix32(_mix32(seed) ^ (position * 0x5851F42D))  # [B]
    cols = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    h = _mix32(row[:, None] ^ (cols[None, :] * 0x3C6EF372))
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(-torch.log(u))


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, excludes; rows with both off are untouched."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)[:, None]
    remove = rank >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
    remove = remove | ((before >= top_p[:, None]) & (rank > 0))
    mask = torch.zeros_like(remove).scatter_(-1, order, remove)
    return logits.masked_fill(mask, float("-inf"))


def log_probs(logits: torch.Tensor, params: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, lp) [B, V] fp32 from logits [B, V]: the log-softmax of the logits as they are,
    and of the distribution :func:`sample` draws from (temperature, then top-k and top-p;
    greedy rows at temperature 1). ``lp`` is ``raw`` itself when nothing changes it."""
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    if params.unit_temperature and not params.any_greedy and not params.needs_filter:
        return raw, raw
    greedy = params.temperature <= 0
    t = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = logits / t[:, None]
    if params.needs_filter:
        scaled = filter_logits(scaled, params.top_k, params.top_p)
    return raw, torch.log_softmax(scaled, dim=-1)


def sample(logits: torch.Tensor, params: SamplingBatch, positions: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype; computed in fp32) -> (token [B] int64,
    logprob [B], raw_logprob [B]).

    ``positions[b]`` is the position the sampled token will occupy (its
    index in prompt + response), the counter of the noise."""
    if params.generator is not None and not params.needs_filter:
        if triton_kernels.sampling_supported(logits):  # greedy rows too (an evaluation beside training)
            return triton_kernels.sample_gumbel(logits, params.temperature, params.unit_temperature, params.generator)
        if params.unit_temperature:  # no greedy row: each sets a temperature other than 1
            return _sample_unit_temperature(logits.float(), params.generator)
    logits = logits.float()
    raw, lp = log_probs(logits, params)
    if params.generator is not None:
        noise = torch.rand(logits.shape, device=logits.device, generator=params.generator)
        noise.clamp_(min=1e-20).log_().neg_().log_().neg_()  # Gumbel(0, 1), in place
    else:
        noise = gumbel_noise(params.seed, positions, logits.shape[-1])
    token = torch.argmax(noise.add_(lp), dim=-1)
    if params.any_greedy:
        token = torch.where(params.temperature <= 0, torch.argmax(logits, dim=-1), token)
    raw_tok = raw.gather(-1, token[:, None]).squeeze(-1)
    if lp is raw:
        return token, raw_tok, raw_tok
    lp_tok = lp.gather(-1, token[:, None]).squeeze(-1)
    if params.any_greedy:
        lp_tok = torch.where(params.temperature <= 0, raw_tok, lp_tok)
    return token, lp_tok, raw_tok


def _sample_unit_temperature(logits: torch.Tensor, generator: torch.Generator
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The common RL case (T=1, no filter, unseeded) in few passes over [B, V]:
    no log-softmax matrix, one logsumexp; Gumbel-max with -log(Exp(1)) noise."""
    noise = torch.empty_like(logits).exponential_(generator=generator)
    noise.clamp_(min=1e-20).log_().neg_().add_(logits)  # logits + Gumbel(0, 1)
    token = torch.argmax(noise, dim=-1)
    raw = logits.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return token, raw, raw
