"""The loss pass both trainer backends run, one micro-batch at a time.

    samples ─► padded_batch: right-padded [B, L] ids, response positions [B, T], mask [B, T]
            ─► the backend's forward: logits [B, L, V]
            ─► response_logprobs: log-probs and entropy of the response tokens [B, T] (temperature 1)
            ─► loss(logprobs, rollout_logprobs, advantages, mask) x the micro-batch's token share
            ─► backward (gradients add up over the micro-batches)

A micro-batch's loss is a token mean over it; scaled by its share of the
batch's (data parallel: the global batch's) response tokens, the summed
gradient is that of the token mean over the whole batch, and so are the
summed metrics (:func:`accumulate_passes`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from actors.backends.base import Loss
from actors.backends.batching import pad_values
from contracts.sample import Sample

__all__ = ["Forward", "accumulate", "accumulate_passes", "padded_batch", "response_logprobs"]

#: A backend's forward over samples: (log-probs ``[B, T]``, entropy ``[B, T]``, mask ``[B, T]``).
Forward = Callable[[list[Sample]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def padded_batch(samples: list[Sample], pad_id: int, device: torch.device,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` ``[B, L]``, and for the
    response: gather index ``[B, T]`` into the logits and ``mask`` ``[B, T]``."""
    if not samples:
        raise ValueError("empty batch")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(lengths)
    num_resp = max(max(len(s.response_ids) for s in samples), 1)
    # Built in numpy, moved once: per-row tensor writes cost a copy (and on CUDA a launch) each.
    ids = np.full((len(samples), width), pad_id, dtype=np.int64)
    # Logits at position p predict token p + 1, so response token j of a
    # sample with prompt length P is scored by the logits at P - 1 + j.
    pos = np.zeros((len(samples), num_resp), dtype=np.int64)
    for i, s in enumerate(samples):
        if len(s.prompt_ids) == 0:  # a list or an array
            raise ValueError(f"sample {s.uid!r} has an empty prompt")
        p, n = len(s.prompt_ids), len(s.response_ids)
        ids[i, :p] = s.prompt_ids
        ids[i, p : p + n] = s.response_ids
        pos[i, :n] = np.arange(p - 1, p - 1 + n)
    attn = (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    resp = np.asarray([len(s.response_ids) for s in samples])
    mask = (np.arange(num_resp)[None, :] < resp[:, None]).astype(np.float32)
    ids, attn, pos, mask = (torch.from_numpy(a) for a in (ids, attn, pos, mask))
    return ids.to(device), attn.to(device), pos.to(device), mask.to(device)


def response_logprobs(logits: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the logits ``[B, L, V]`` of :func:`padded_batch`'s ``ids``: log-probs
    ``[B, T]`` of each response token (temperature 1, zero where masked), entropy
    ``[B, T]`` and the mask."""
    idx = pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    logp_all = torch.log_softmax(torch.gather(logits, 1, idx).float(), dim=-1)  # [B, T, V]
    targets = torch.gather(ids, 1, (pos + 1).clamp(max=ids.shape[1] - 1))  # [B, T]
    logprobs = torch.gather(logp_all, 2, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs * mask, entropy, mask


def accumulate(loss: Loss, forward: Forward, samples: list[Sample], advantages: list[float],
               proximal_logprobs: list[list[float]] | None, weight: float) -> dict[str, float]:
    """Forward + backward of one micro-batch; its loss (a token mean over the
    micro-batch) is scaled by ``weight``, its share of the batch's tokens.
    Returns the micro-batch's loss, entropy and the loss's metrics."""
    extra = {}
    if loss.needs_proximal and proximal_logprobs is None:
        # The weights before this step are the proximal policy.
        with torch.no_grad():
            extra["proximal_logprobs"] = forward(samples)[0]
    logprobs, entropy, mask = forward(samples)
    if loss.needs_proximal and proximal_logprobs is not None:
        extra["proximal_logprobs"] = pad_values(samples, proximal_logprobs, "proximal_logprobs", like=logprobs)
    rollout = pad_values(samples, [s.rollout_logprobs for s in samples], "rollout_logprobs", like=logprobs)
    adv = torch.tensor(advantages, dtype=logprobs.dtype, device=logprobs.device)
    value, metrics = loss(logprobs, rollout, adv, mask, **extra)
    (value * weight).backward()
    num_tokens = float(mask.sum())
    return {
        "loss": float(value.detach()),
        "entropy": float((entropy.detach() * mask).sum() / max(num_tokens, 1.0)),
        **{k: float(v) for k, v in metrics.items()},
    }


def accumulate_passes(loss: Loss, forward: Forward, samples: list[Sample], advantages: list[float],
                      proximal_logprobs: list[list[float]] | None, passes: list[list[int] | None],
                      total_tokens: float, sums: dict[str, float], filler: Sample | None = None) -> dict[str, float]:
    """:func:`accumulate` over ``passes`` (index lists into ``samples``; ``None``: a
    weight-0 pass on ``filler``, whose collectives match a busier rank's), each
    weighted by its share of ``total_tokens``. Adds the token-weighted metrics
    into ``sums`` (a weight-0 pass only names its keys) and returns it."""
    for idx in passes:
        if idx is None:
            assert filler is not None, "a weight-0 pass needs a filler sample"
            prox = None if proximal_logprobs is None else [[0.0]]
            for k in accumulate(loss, forward, [filler], [0.0], prox, 0.0):
                sums.setdefault(k, 0.0)
            continue
        part = [samples[i] for i in idx]
        prox = None if proximal_logprobs is None else [proximal_logprobs[i] for i in idx]
        weight = sum(len(s.response_ids) for s in part) / max(total_tokens, 1)
        for k, v in accumulate(loss, forward, part, [advantages[i] for i in idx], prox, weight).items():
            sums[k] = sums.get(k, 0.0) + v * weight
    return sums
