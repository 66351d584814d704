"""The unit of data that flows rollout → TransferQueue → trainer."""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

FinishReason = Literal["stop", "length", "abort", "error"]


class Sample(msgspec.Struct, kw_only=True):
    """One response to one prompt, with everything the loss needs.

    ``group_id`` ties the ``n`` samples of one prompt together (GRPO group).
    ``token_versions[i]`` is the weight version that sampled ``response_ids[i]``;
    ``min_version``/``max_version`` summarise it (a resumed partial rollout
    spans several versions). ``reward`` is ``None`` until the sample is scored.

    The four token fields are Python lists, or 1-D numpy arrays as an engine
    may hand them over. The TransferQueue
    carries an array as its bytes (int32 ids and versions, float32 log-probs)
    and ``Batch.samples`` hands it back as a read-only array; ``Batch.column``
    gives any token field of a batch as arrays.
    """

    uid: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int] = msgspec.field(default_factory=list)
    rollout_logprobs: list[float] = msgspec.field(default_factory=list)
    token_versions: list[int] = msgspec.field(default_factory=list)
    reward: float | None = None
    finish_reason: FinishReason | None = None
    num_resumes: int = 0
    # Task data the reward needs (e.g. the reference answer); never trained on.
    meta: dict[str, str] = msgspec.field(default_factory=dict)
    # Wall-clock stamps (time.time()) for latency metrics; 0.0 means "not yet".
    created_s: float = 0.0
    finished_s: float = 0.0
    # Error text when finish_reason == "error" (e.g. the reward function raised).
    error: str | None = None

    @property
    def min_version(self) -> int:
        return min_version_of(self.token_versions)

    @property
    def max_version(self) -> int:
        return max_version_of(self.token_versions)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)


# Token fields and the dtype they have as arrays (``pack_tokens``, ``Batch.column``).
TOKEN_DTYPES: dict[str, type] = {
    "prompt_ids": np.int32,
    "response_ids": np.int32,
    "rollout_logprobs": np.float32,
    "token_versions": np.int32,
}


def pack_tokens(sample: Sample) -> Sample:
    """Turn ``sample``'s token fields into numpy arrays (``TOKEN_DTYPES``), in place, once
    it is finished: arrays cross processes and the TransferQueue as their bytes, and the
    trainer copies them into its batch tensors without a Python object per token."""
    for name, dtype in TOKEN_DTYPES.items():
        setattr(sample, name, np.asarray(getattr(sample, name), dtype))
    return sample


def min_version_of(versions: list[int] | np.ndarray) -> int:
    """The smallest of per-token ``versions`` (-1 when there are none)."""
    return _version_bound(versions, min, np.min)


def max_version_of(versions: list[int] | np.ndarray) -> int:
    """The largest of per-token ``versions`` (-1 when there are none)."""
    return _version_bound(versions, max, np.max)


def _version_bound(versions: list[int] | np.ndarray, pick, pick_array) -> int:
    if len(versions) == 0:
        return -1
    if isinstance(versions, np.ndarray):
        return int(pick_array(versions))
    # One weight version throughout is the common case; count() is a C loop, min()/max() are not.
    return versions[0] if versions.count(versions[0]) == len(versions) else pick(versions)


def batch_stats(samples: list[Sample], version: int) -> dict[str, float]:
    """Reward, staleness (``version`` minus each sample's oldest token version),
    resumes and lengths of a training batch, as flat metrics.
    ``zero_adv_group_share``: the share of its groups whose rewards are all equal
    (no reward variance: zero group-relative advantage, no gradient)."""
    lags = [version - s.min_version for s in samples]
    num_tokens = sum(len(s.response_ids) for s in samples)
    n = len(samples)
    rewards: dict[str, set[float | None]] = {}
    for s in samples:
        rewards.setdefault(s.group_id, set()).add(s.reward)
    return {
        "reward": sum(s.reward or 0.0 for s in samples) / n,
        "staleness_mean": sum(lags) / n,
        "staleness_max": max(lags),
        "partial_ratio": sum(1 for s in samples if s.num_resumes > 0) / n,
        "max_resumes": max(s.num_resumes for s in samples),
        "max_resume_span": max(s.max_version - s.min_version for s in samples),
        "response_len_mean": num_tokens / n,
        "zero_adv_group_share": sum(len(r) == 1 for r in rewards.values()) / len(rewards),
    }
