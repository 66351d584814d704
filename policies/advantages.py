"""Group-relative advantages (GRPO)."""

from __future__ import annotations

from typing import Literal

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    eps: float = 1e-6,
    scale: Literal["std", "none"] = "std",
) -> torch.Tensor:
    """How much better each response did than the other responses to the same prompt.

    ``rewards[b]`` is the reward of response ``b``; ``group_index[b]`` (an
    integer) says which prompt it answered. Each reward has its group's mean
    reward subtracted. With ``scale="std"`` the result is also divided by the
    group's standard deviation (population std, i.e. divide by the group size,
    plus ``eps``) so every prompt pulls with similar strength whatever its
    reward spread; ``scale="none"`` keeps the raw difference (Dr. GRPO style).
    A group whose responses all got the same reward gets advantage 0 for all
    of them: it carries no signal about which response was better.

    Returns a float tensor shaped like ``rewards`` ``[B]``.
    """
    if rewards.ndim != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards and group_index must both be [B], got {tuple(rewards.shape)} and {tuple(group_index.shape)}")
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    rewards = rewards.to(torch.float64)  # exact group means for ties
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(rewards))
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, rewards)
    mean = (sums / counts)[inverse]
    centred = rewards - mean
    if scale == "std":
        var = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, centred**2) / counts
        centred = centred / (var.sqrt()[inverse] + eps)
    return centred.to(torch.float32)
