"""Policy-gradient losses and off-policy corrections, picked by name in config.

Every loss has the same shape of call::

    loss, metrics = fn(logprobs, rollout_logprobs, advantages, mask, *,
                       proximal_logprobs=None, **options)

    logprobs           [B, T]  log-prob of each response token under the weights
                               being trained (carries the gradient)
    rollout_logprobs   [B, T]  log-prob the rollout engine sampled it with
                               (the behaviour policy; may be several versions old)
    advantages         [B] or [B, T]  one per response (broadcast) or per token
    mask               [B, T]  1 on real response tokens, 0 on padding
    proximal_logprobs  [B, T]  (decoupled_ppo only) log-probs under the weights
                               the trainer held before this step, no gradient

Aggregation: **token mean over the whole batch** — the per-token losses are
summed over every real response token and divided by the number of such
tokens. Each token counts the same wherever it sits, so long responses are
not down-weighted per token as a per-sequence mean would do (DAPO's choice),
and the loss scale does not depend on how the batch was padded.

``metrics`` holds detached 0-d tensors (token means over the mask): the trainer reads
them from the device once a step, with its grad norm (``actors.backends.loss_pass.PassMetrics``).

A trainer backend gets its loss injected as a :class:`Loss`: the function
picked by name with its options bound, built by the composition root::

    loss = make_loss_from_config(cfg.trainer)          # or make_loss("ppo_clip", clip_eps_low=0.2)
    loss(logprobs, rollout_logprobs, advantages, mask, proximal_logprobs=None) -> (loss, metrics)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor | float]]]


def _metric(x: torch.Tensor) -> torch.Tensor:
    """A metric as a detached 0-d tensor: read from the device with the step's others, not here."""
    return x.detach().reshape(())


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over real tokens divided by the number of real tokens (0 if none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1).expand_as(like) if advantages.ndim == 1 else advantages


def _check(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    if logprobs.shape != rollout_logprobs.shape or logprobs.shape != mask.shape or logprobs.ndim != 2:
        raise ValueError(
            f"logprobs, rollout_logprobs and mask must all be [B, T]; got "
            f"{tuple(logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}"
        )


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float,
                       high: float, dual_clip: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Per-token ``min(ratio * A, clip(ratio) * A)`` ``[B, T]``, with clip_frac and ratio_mean.

    ``dual_clip`` (c > 1, dual-clip PPO): where A < 0 the term is held at or above ``c * A``, so a
    token the sampler found far less likely than the trained weights do (ratio > c) adds no
    gradient, where plain PPO pushes it down in proportion to its ratio; metric ``dual_clip_frac``."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    with torch.no_grad():
        metrics: dict[str, torch.Tensor | float] = {
            "clip_frac": _metric(_token_mean((clipped < unclipped).to(mask.dtype), mask)),
            "ratio_mean": _metric(_token_mean(ratio, mask)),
        }
    if dual_clip is not None:
        if not dual_clip > 1.0:
            raise ValueError(f"clip_ratio_c must be above 1, got {dual_clip}")
        floor = dual_clip * adv
        held = (adv < 0) & (surrogate < floor)
        surrogate = torch.where(held, floor, surrogate)
        metrics["dual_clip_frac"] = _metric(_token_mean(held.to(mask.dtype), mask))
    return surrogate, metrics


def ppo_clip(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    clip_ratio_c: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """PPO's clipped surrogate against the behaviour (rollout) policy.

    ratio = exp(logprobs - rollout_logprobs) says how much more likely the
    current weights make each sampled token than the sampler did. Each token's
    loss is -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A): push
    up tokens with positive advantage, down those with negative advantage, but
    stop pushing once the ratio has left the trust band in the helpful
    direction. ``proximal_logprobs`` is ignored (accepted so every loss takes
    the same arguments). ``clip_ratio_c``: dual clip (see :func:`_clipped_surrogate`).
    Metrics: ``clip_frac`` (share of tokens whose clipped
    term is the active one), ``ratio_mean``, ``kl_behav`` (mean of
    rollout_logprobs - logprobs, a cheap KL estimate).
    """
    _check(logprobs, rollout_logprobs, mask)
    mask = mask.to(logprobs.dtype)
    adv = _per_token(advantages, logprobs).to(logprobs.dtype)
    ratio = torch.exp(logprobs - rollout_logprobs)
    surrogate, metrics = _clipped_surrogate(ratio, adv, mask, clip_eps_low, clip_eps_high, clip_ratio_c)
    loss = _token_mean(-surrogate, mask)
    metrics["kl_behav"] = _metric(_token_mean(rollout_logprobs - logprobs, mask))
    return loss, metrics


def decoupled_ppo(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    behav_weight_cap: float = 5.0,
    cap_mode: str = "truncate",
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Decoupled PPO (AReaL): trust region around the trainer's own recent
    weights, importance weights for the staleness of the sampler.

    In fully-async training the sampler (behaviour policy) may be several
    versions old. Clipping against it would make the trust region as wide as
    the staleness. Instead the trust region is taken around the proximal
    policy — the weights the trainer holds now, before this step, whose
    log-probs the trainer recomputes (``proximal_logprobs``, no gradient):

        ratio  = exp(logprobs - proximal_logprobs)           (clipped as in PPO)
        weight = exp(proximal_logprobs - rollout_logprobs)   (fixed, corrects sampling)
        token loss = -weight * min(ratio * A, clip(ratio) * A)

    ``weight`` is capped at ``behav_weight_cap`` so a token the sampler found
    unlikely cannot dominate: ``cap_mode="truncate"`` sets it to the cap,
    ``cap_mode="mask"`` drops the token from the loss (AReaL's default) while
    still counting it in the token-mean denominator. ``clip_ratio_c``: dual clip of the
    proximal ratio (see :func:`_clipped_surrogate`). Metrics add
    ``behav_weight_mean`` and ``behav_capped_frac``.
    """
    if proximal_logprobs is None:
        raise ValueError("decoupled_ppo needs proximal_logprobs (the trainer's log-probs before this step)")
    if cap_mode not in ("truncate", "mask"):
        raise ValueError(f"cap_mode must be 'truncate' or 'mask', got {cap_mode!r}")
    _check(logprobs, rollout_logprobs, mask)
    mask = mask.to(logprobs.dtype)
    adv = _per_token(advantages, logprobs).to(logprobs.dtype)
    proximal_logprobs = proximal_logprobs.detach()
    ratio = torch.exp(logprobs - proximal_logprobs)
    surrogate, metrics = _clipped_surrogate(ratio, adv, mask, clip_eps_low, clip_eps_high, clip_ratio_c)
    weight = torch.exp(proximal_logprobs - rollout_logprobs)
    capped = weight > behav_weight_cap
    if cap_mode == "truncate":
        weight = weight.clamp(max=behav_weight_cap)
    else:
        weight = torch.where(capped, torch.zeros_like(weight), weight)
    loss = _token_mean(-weight * surrogate, mask)
    with torch.no_grad():
        metrics |= {
            "behav_weight_mean": _metric(_token_mean(weight, mask)),
            "behav_capped_frac": _metric(_token_mean(capped.to(mask.dtype), mask)),
            "kl_behav": _metric(_token_mean(rollout_logprobs - logprobs, mask)),
        }
    return loss, metrics


def tis_token(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    proximal_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Policy gradient with per-token truncated importance sampling.

    Each token's gradient is the REINFORCE term A * grad(logprob) scaled by
    w = min(exp(logprobs - rollout_logprobs), cap), computed without gradient:
    the token is re-weighted by how much more (or less) likely the current
    weights make it than the sampler did, but never by more than ``cap`` so a
    rare token cannot blow up the step. Token loss = -w * A * logprobs.
    At w < cap its gradient equals that of -ratio * A (unclipped PPO).
    Metrics: ``is_weight_mean``, ``truncated_frac``, ``ratio_mean``.
    """
    _check(logprobs, rollout_logprobs, mask)
    mask = mask.to(logprobs.dtype)
    adv = _per_token(advantages, logprobs).to(logprobs.dtype)
    ratio = torch.exp(logprobs.detach() - rollout_logprobs)
    weight = ratio.clamp(max=cap)
    loss = _token_mean(-weight * adv * logprobs, mask)
    metrics: dict[str, torch.Tensor | float] = {
        "is_weight_mean": _metric(_token_mean(weight, mask)),
        "truncated_frac": _metric(_token_mean((ratio > cap).to(mask.dtype), mask)),
        "ratio_mean": _metric(_token_mean(ratio, mask)),
    }
    return loss, metrics


def tis_seq(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    proximal_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Policy gradient with sequence-level truncated importance sampling.

    Like :func:`tis_token`, but one weight per response: the ratio of the
    whole sequence's probabilities, w = min(exp(sum over its tokens of
    logprobs - rollout_logprobs), cap), without gradient, applied to every
    token of that response. Unbiased for whole-sequence rewards when not
    truncated, at the price of higher variance. Token loss = -w_b * A * logprobs;
    token-mean aggregation as everywhere. Metrics: ``is_weight_mean`` (mean
    over responses), ``truncated_frac`` (share of responses capped).
    """
    _check(logprobs, rollout_logprobs, mask)
    mask = mask.to(logprobs.dtype)
    adv = _per_token(advantages, logprobs).to(logprobs.dtype)
    log_ratio_seq = ((logprobs.detach() - rollout_logprobs) * mask).sum(dim=-1)  # [B]
    # Clamp in log space: exp of a long sequence's summed log-ratio overflows.
    weight = torch.exp(log_ratio_seq.clamp(max=math.log(cap)))  # [B]
    loss = _token_mean(-weight.unsqueeze(-1) * adv * logprobs, mask)
    has_tokens = (mask.sum(dim=-1) > 0).to(mask.dtype)
    num_seqs = has_tokens.sum().clamp(min=1)
    metrics: dict[str, torch.Tensor | float] = {
        "is_weight_mean": _metric((weight * has_tokens).sum() / num_seqs),
        "truncated_frac": _metric(((log_ratio_seq > math.log(cap)).to(mask.dtype) * has_tokens).sum() / num_seqs),
    }
    return loss, metrics


_LOSSES: dict[str, LossFn] = {
    "ppo_clip": ppo_clip,
    "decoupled_ppo": decoupled_ppo,
    "tis_token": tis_token,
    "tis_seq": tis_seq,
}

#: Losses that need the trainer to recompute proximal log-probs before the step.
NEEDS_PROXIMAL = frozenset({"decoupled_ppo"})

_TENSOR_ARGS = frozenset({"logprobs", "rollout_logprobs", "advantages", "mask", "proximal_logprobs"})


@dataclasses.dataclass(frozen=True)
class Loss:
    """A loss function with its options bound: the one callable a trainer backend runs.

    ``fn`` is a module-level loss function and ``options`` plain numbers and strings, so a
    ``Loss`` pickles by reference into child processes and Ray actors.
    ``needs_proximal``: the backend must pass ``proximal_logprobs`` (the
    log-probs of the weights before the step). ``name`` goes into checkpoints.
    """

    name: str
    fn: LossFn
    options: Mapping[str, float | str] = dataclasses.field(default_factory=dict)
    needs_proximal: bool = False

    def __call__(self, logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, proximal_logprobs: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        return self.fn(logprobs, rollout_logprobs, advantages, mask, proximal_logprobs=proximal_logprobs,
                       **self.options)


def make_loss(name: str, **options: float | str) -> Loss:
    """The loss registered as ``name`` with ``options`` bound (see the module
    docstring for its call). ``ValueError`` names an unknown loss or option."""
    if name not in _LOSSES:
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(sorted(_LOSSES))}")
    fn = _LOSSES[name]
    accepted = set(inspect.signature(fn).parameters) - _TENSOR_ARGS
    if unknown := sorted(set(options) - accepted):
        raise ValueError(f"loss {name!r} has no option(s) {unknown}; it accepts {sorted(accepted)}")
    return Loss(name=name, fn=fn, options=dict(options), needs_proximal=name in NEEDS_PROXIMAL)


class LossSection(Protocol):
    """What :func:`make_loss_from_config` reads of the ``trainer`` section
    (``actors.backends.TrainerConfig``; ``policies`` never imports ``actors``)."""

    @property
    def loss(self) -> str: ...

    @property
    def clip_eps(self) -> float: ...

    @property
    def is_cap(self) -> float: ...

    @property
    def is_cap_mode(self) -> str: ...

    @property
    def clip_ratio_c(self) -> float | None: ...


def make_loss_from_config(trainer: LossSection) -> Loss:
    """The loss a ``trainer`` config section names (``loss``), with its options
    taken from the section: ``clip_eps`` (both sides of the PPO clip range) and
    ``is_cap`` (the cap of truncated importance weights), ``is_cap_mode`` (decoupled_ppo's, where
    not ``truncate``), ``clip_ratio_c`` (dual clip, where set)."""
    options: dict[str, float | str]
    if trainer.loss in ("ppo_clip", "decoupled_ppo"):
        options = {"clip_eps_low": trainer.clip_eps, "clip_eps_high": trainer.clip_eps}
        if trainer.loss == "decoupled_ppo":
            options["behav_weight_cap"] = trainer.is_cap
            if trainer.is_cap_mode != "truncate":
                options["cap_mode"] = trainer.is_cap_mode
        if trainer.clip_ratio_c is not None:
            options["clip_ratio_c"] = trainer.clip_ratio_c
    else:
        options = {"cap": trainer.is_cap}
    return make_loss(trainer.loss, **options)
