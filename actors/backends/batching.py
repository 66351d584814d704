"""Batch helpers both trainer backends share: input checks, token-budget
micro-batches and per-token padding (right-padded rows, response positions)."""

from __future__ import annotations

import numpy as np
import torch

from contracts.sample import Sample

__all__ = ["batch_error", "micro_batch_budget", "micro_batches", "pad_values"]


def batch_error(samples: list[Sample], advantages: list[float] | None = None,
                 proximal_logprobs: list[list[float]] | None = None) -> str | None:
    """What is wrong with a rank's batch (checked before any collective), or None.
    ``advantages`` None: log-probs only, no training fields to check."""
    if advantages is not None and len(advantages) != len(samples):
        return f"got {len(advantages)} advantages for {len(samples)} samples"
    if proximal_logprobs is not None and len(proximal_logprobs) != len(samples):
        return f"got proximal_logprobs for {len(proximal_logprobs)} samples, expected {len(samples)}"
    for i, s in enumerate(samples):
        if len(s.prompt_ids) == 0:
            return f"sample {s.uid!r} has an empty prompt"
        if advantages is None:
            continue
        for what, values in (("rollout_logprobs", s.rollout_logprobs),
                             ("proximal_logprobs", None if proximal_logprobs is None else proximal_logprobs[i])):
            if values is not None and len(values) != len(s.response_ids):
                return f"sample {s.uid!r} has {len(values)} {what} for {len(s.response_ids)} response tokens"
    return None


def micro_batch_budget(value: int | None, device: torch.device) -> int:
    """``trainer.micro_batch_tokens`` checked, its default (None) resolved for ``device``."""
    if value is None:
        return 16384 if device.type == "cuda" else 2048
    if value < 0:
        raise ValueError(f"micro_batch_tokens must be >= 0, got {value}")
    return value


def micro_batches(samples: list[Sample], budget: int, *, packed: bool = False) -> list[list[int]]:
    """Indices split so rows x longest row <= ``budget``, rows
    sorted by length: a long-tailed batch stops padding every row to its longest.
    ``packed``: the sum of the rows' lengths <= ``budget`` (one row of packed
    sequences, no padding); a row longer than the budget gets a pass of its own."""
    if not budget:
        return [list(range(len(samples)))]
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].response_ids))
    out: list[list[int]] = [[]]
    used = 0  # packed: tokens in the last pass
    for i in order:
        width = len(samples[i].prompt_ids) + len(samples[i].response_ids)
        if out[-1] and (used + width if packed else (len(out[-1]) + 1) * width) > budget:
            out.append([])
            used = 0
        out[-1].append(i)
        used += width
    return out


def pad_values(samples: list[Sample], values: list[list[float]], what: str, *, like: torch.Tensor) -> torch.Tensor:
    """Per-token values (one list per sample) as a zero-padded tensor shaped ``like`` ``[B, T]``."""
    if len(values) != len(samples):
        raise ValueError(f"got {what} for {len(values)} samples, expected {len(samples)}")
    out = np.zeros(tuple(like.shape), dtype=np.float32)
    for i, (s, v) in enumerate(zip(samples, values)):
        if len(v) != len(s.response_ids):
            raise ValueError(f"sample {s.uid!r} has {len(v)} {what} for {len(s.response_ids)} response tokens")
        out[i, : len(v)] = v
    return torch.from_numpy(out).to(device=like.device, dtype=like.dtype)
