"""Exact speculative sampling (``docs/mtp.md``, "Speculative decoding"): drafts
``d_1..d_K`` drawn from the MTP modules' distributions ``q_j``, verified against
the full model's ``p_j`` so that the emitted tokens are distributed as the full
model samples them, one by one.

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), j = 1, 2, ...
    first rejection at j: emit a draw from normalize(max(0, p_j - q_j)) and stop
    all accepted: emit a bonus draw from p_{K+1}

``p`` and ``q`` are the distributions the engine's sampler draws from
(:func:`actors.engines.sampling.log_probs`: temperature, top-k, top-p). Greedy rows
accept a draft iff it is the argmax of ``p_j``, else emit that argmax. Randomness:
for a batch with a seeded row, counter-based noise keyed by (seed, position,
purpose) (:func:`~actors.engines.sampling.gumbel_noise`), so a seeded request draws
the same whatever batch it is in; otherwise the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from actors.engines.sampling import SamplingBatch, gumbel_noise, log_probs

__all__ = ["SpecResult", "accepts", "draw", "speculative_sample"]

_MASK32 = 0xFFFFFFFF
# What a random draw at a position is for: its own noise each (a position may see a draft
# drawn, a draft tested and a correction drawn); BONUS is the plain sampler's (purpose 0).
BONUS, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3


@dataclass
class SpecResult:
    """One speculative step's outcome per row, on the device."""

    tokens: torch.Tensor  # [B, K+1] int64: d_1..d_a, then the correction or bonus; later columns unused
    num_accepted: torch.Tensor  # [B] int64: a, drafts accepted (the row emits a + 1 tokens)
    logprobs: torch.Tensor  # [B, K+1] fp32: the full model's sampling log-prob of each token
    raw_logprobs: torch.Tensor  # [B, K+1] fp32: ... and its raw (T=1) log-prob


def _seeds(params: SamplingBatch, purpose: int) -> torch.Tensor:
    return (params.seed ^ ((purpose * 0x632BE5AB) & _MASK32)) & _MASK32


def _gumbel(params: SamplingBatch, positions: torch.Tensor, shape: tuple[int, ...], purpose: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] for tokens at ``positions`` [B]."""
    if params.generator is not None:
        u = torch.rand(shape, device=positions.device, generator=params.generator)
        return u.clamp_(min=1e-20).log_().neg_().log_().neg_()
    return gumbel_noise(_seeds(params, purpose), positions, shape[-1])


def _uniform(params: SamplingBatch, positions: torch.Tensor) -> torch.Tensor:
    """U(0, 1) [B, K] for the acceptance tests of the drafts at ``positions`` [B, K]."""
    if params.generator is not None:
        return torch.rand(positions.shape, device=positions.device, generator=params.generator)
    B, K = positions.shape
    seeds = _seeds(params, ACCEPT)[:, None].expand(B, K).reshape(-1)
    g = gumbel_noise(seeds, positions.reshape(-1), 1)[:, 0]  # -log(-log u): invert it
    return torch.exp(-torch.exp(-g)).view(B, K)


def draw(raw: torch.Tensor, lp: torch.Tensor, params: SamplingBatch, positions: torch.Tensor,
         purpose: int) -> torch.Tensor:
    """Tokens [B] drawn from ``lp`` [B, V] (log-probs; -inf excluded) for ``positions`` [B];
    greedy rows take the argmax of ``raw``."""
    token = torch.argmax(_gumbel(params, positions, tuple(lp.shape), purpose) + lp, dim=-1)
    if params.any_greedy:
        token = torch.where(params.temperature <= 0, torch.argmax(raw, dim=-1), token)
    return token


def accepts(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """The acceptance rule: d_j is kept iff u_j < p_j(d_j) / q_j(d_j) (u ~ U(0, 1)), all [B, K]."""
    return u * q_draft < p_draft


def _per_position(params: SamplingBatch, n: int) -> SamplingBatch:
    """``params`` with each row repeated ``n`` times (rows of a flattened [B * n, V])."""
    return replace(params, temperature=params.temperature.repeat_interleave(n),
                   top_k=params.top_k.repeat_interleave(n), top_p=params.top_p.repeat_interleave(n),
                   seed=params.seed.repeat_interleave(n))


def speculative_sample(logits: torch.Tensor, drafts: torch.Tensor, draft_lp: torch.Tensor,
                       params: SamplingBatch, position: torch.Tensor) -> SpecResult:
    """logits [B, K+1, V]: the full model's at the verified tokens ``t_p, d_1..d_K``;
    drafts [B, K] with the log-probs [B, K, V] they were drawn from; ``position`` [B]: p,
    so draft j sits at ``p + j``."""
    B, K1, V = logits.shape
    K = K1 - 1
    raw, lp = log_probs(logits.reshape(B * K1, V), _per_position(params, K1))
    raw, lp = raw.view(B, K1, V), lp.view(B, K1, V)
    at = position[:, None] + torch.arange(1, K1 + 1, device=position.device)  # [B, K+1]: where each emitted token sits
    d = drafts[..., None]
    ok = accepts(_uniform(params, at[:, :K]), lp[:, :K].gather(-1, d).squeeze(-1).exp(),
                 draft_lp.gather(-1, d).squeeze(-1).exp())
    if params.any_greedy:
        ok = torch.where((params.temperature <= 0)[:, None], drafts == raw[:, :K].argmax(-1), ok)
    a = ok.long().cumprod(-1).sum(-1)  # [B]: leading accepts
    rows = torch.arange(B, device=logits.device)
    j = a.clamp(max=K - 1)
    p_j, q_j = lp[rows, j].exp(), draft_lp[rows, j].exp()
    residual = (p_j - q_j).clamp_(min=0)
    residual_lp = torch.where(residual.sum(-1, keepdim=True) > 0, residual.log(), lp[rows, j])
    correction = draw(raw[rows, j], residual_lp, params, at[rows, j], RESIDUAL)
    bonus = draw(raw[:, K], lp[:, K], params, at[:, K], BONUS)
    last = torch.where(a < K, correction, bonus)
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1).scatter_(1, a[:, None], last[:, None])
    tok = tokens[..., None]
    raw_tok = raw.gather(-1, tok).squeeze(-1)
    lp_tok = lp.gather(-1, tok).squeeze(-1)
    if params.any_greedy:
        lp_tok = torch.where((params.temperature <= 0)[:, None], raw_tok, lp_tok)
    return SpecResult(tokens, a, lp_tok, raw_tok)
