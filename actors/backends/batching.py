"""Batch helpers both trainer backends share: input checks, token-budget
micro-batches, per-token padding (right-padded rows, response positions) and
the one host-to-device copy a micro-batch's inputs take (:func:`to_device`)."""

from __future__ import annotations

import numpy as np
import torch

from contracts.sample import Sample

__all__ = ["batch_error", "micro_batch_budget", "micro_batches", "pad_values", "to_device"]


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


def pad_values(samples: list[Sample], values: list[list[float]], what: str, width: int) -> np.ndarray:
    """Per-token values (one list per sample) as a zero-padded float32 array ``[B, width]``."""
    if len(values) != len(samples):
        raise ValueError(f"got {what} for {len(values)} samples, expected {len(samples)}")
    out = np.zeros((len(samples), width), dtype=np.float32)
    for i, (s, v) in enumerate(zip(samples, values)):
        if len(v) != len(s.response_ids):
            raise ValueError(f"sample {s.uid!r} has {len(v)} {what} for {len(s.response_ids)} response tokens")
        out[i, : len(v)] = v
    return out


#: Where every array starts in the staging buffer of :func:`to_device` (the widest element size).
_ALIGN_BYTES = 8
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` as tensors on ``device`` (same dtypes and shapes), in one copy.

    On CUDA they are staged back to back in one pinned buffer and copied with
    ``non_blocking``: a copy from pageable memory, or one copy per array, would
    each wait for the stream to drain (a host-device sync) in the middle of the
    step. The tensors are views of that one device buffer. On a CPU they share
    the arrays' memory (no copy)."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    return _one_copy(arrays, device)


def _one_copy(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """:func:`to_device` through one staging buffer (pinned on CUDA), whatever the device."""
    offsets, num_bytes = [], 0
    for a in arrays:
        offsets.append(num_bytes)
        num_bytes += -(-a.nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
    # the caching host allocator keeps the pinned block until the copy that reads it has run
    staging = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host = staging.numpy()
    for a, o in zip(arrays, offsets):
        host[o : o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    moved = staging.to(device, non_blocking=device.type == "cuda")
    return [moved[o : o + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, o in zip(arrays, offsets)]
