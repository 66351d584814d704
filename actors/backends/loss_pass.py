"""The loss pass both trainer backends run, one micro-batch at a time.

    samples ─► padded_batch: right-padded [B, L] ids, response positions [B, T], mask [B, T]
            ─► the backend's forward: logits [B, L, V]
            ─► response_logprobs: log-probs and entropy of the response tokens [B, T] (temperature 1)
            ─► loss(logprobs, rollout_logprobs, advantages, mask) (+ an auxiliary loss the same
               forward computed: model.mtp_layers) x the micro-batch's token share
            ─► backward (gradients add up over the micro-batches)

A micro-batch's loss is a token mean over it; scaled by its share of the
batch's (data parallel: the global batch's) response tokens, the summed
gradient is that of the token mean over the whole batch, and so are the
summed metrics (:func:`accumulate_passes`).

Nothing here waits on the device: a micro-batch's host inputs go over in one
non-blocking copy (``batching.to_device``) and its metrics stay on the device
(:class:`PassMetrics`) until the caller reads them all at once, at the end of
the step, so the launch queue never drains in the middle of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from actors.backends.base import Loss
from actors.backends.batching import pad_values, to_device
from contracts.sample import Sample

__all__ = ["Aux", "Forward", "PassMetrics", "accumulate", "accumulate_passes", "padded_batch", "response_logprobs",
           "run_passes"]

#: A backend's forward over samples: (log-probs ``[B, T]``, entropy ``[B, T]``, mask ``[B, T]``).
Forward = Callable[[list[Sample]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
#: What the last training forward computed besides the log-probs: an auxiliary loss (0-d, in
#: the graph, added to the policy loss before the backward) and its metrics (the MTP loss).
Aux = Callable[[], tuple[torch.Tensor, dict[str, torch.Tensor | float]]]


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
    ids, attn, pos, mask = to_device([ids, attn, pos, mask], device)  # one copy, not one per tensor
    return ids, attn, pos, mask


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
               proximal_logprobs: list[list[float]] | None, weight: float,
               aux: Aux | None = None) -> dict[str, torch.Tensor | float]:
    """Forward + backward of one micro-batch; its loss (a token mean over the
    micro-batch, plus ``aux()``'s loss when given) is scaled by ``weight``, its share of the batch's tokens.
    Returns the micro-batch's loss, entropy and the loss's metrics, unread: 0-d
    device tensors (a loss's metric may be a float already)."""
    width = max(max(len(s.response_ids) for s in samples), 1)  # the [B, T] of every forward
    host = [pad_values(samples, [s.rollout_logprobs for s in samples], "rollout_logprobs", width),
            np.asarray(advantages, dtype=np.float32)]
    if loss.needs_proximal and proximal_logprobs is not None:
        host.append(pad_values(samples, proximal_logprobs, "proximal_logprobs", width))
    extra = {}
    if loss.needs_proximal and proximal_logprobs is None:
        # The weights before this step are the proximal policy.
        with torch.no_grad():
            extra["proximal_logprobs"] = forward(samples)[0]
    logprobs, entropy, mask = forward(samples)
    assert logprobs.shape == (len(samples), width), (tuple(logprobs.shape), width)
    rollout, adv, *proximal = (t.to(logprobs.dtype) for t in to_device(host, logprobs.device))
    if proximal:
        extra["proximal_logprobs"] = proximal[0]
    value, metrics = loss(logprobs, rollout, adv, mask, **extra)
    total = value
    if aux is not None:
        aux_loss, aux_metrics = aux()
        total, metrics = value + aux_loss, {**metrics, **aux_metrics}
    (total * weight).backward()
    num_tokens = float(sum(len(s.response_ids) for s in samples))  # mask.sum(), known here
    return {
        "loss": value.detach(),
        "entropy": (entropy.detach() * mask).sum() / max(num_tokens, 1.0),
        **{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()},
    }


class PassMetrics:
    """The metrics of a step's passes, left on the device until :meth:`read`.

    Each pass's tensor metrics are stacked into one small tensor; :meth:`read`
    moves them all (and whatever the caller adds, e.g. the grad norm) in one
    transfer, then sums them weighted on the host in float64, in pass order:
    the numbers a float() per metric per pass gave, for one sync per step."""

    def __init__(self) -> None:
        self.keys: list[str] = []  # in the order the passes named them
        # per pass: its weight, the names of its tensor metrics, them stacked [K], its float metrics
        self._passes: list[tuple[float, list[str], torch.Tensor | None, dict[str, float]]] = []

    def add(self, metrics: dict[str, torch.Tensor | float], weight: float) -> None:
        """A pass's metrics, ``weight`` its share of the batch's tokens."""
        self.name(metrics)
        names = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
        stacked = torch.stack([metrics[k].reshape(()) for k in names]) if names else None
        self._passes.append((weight, names, stacked, {k: float(v) for k, v in metrics.items() if k not in names}))

    def name(self, keys: Iterable[str]) -> None:
        """Keys a weight-0 pass had: they appear in :meth:`read` (0 when no pass adds to them)."""
        self.keys += [k for k in keys if k not in self.keys]

    def read(self, sums: dict[str, float] | None = None, **extra: torch.Tensor | float) -> dict[str, float]:
        """The token-weighted sums added into ``sums`` (new keys after its own), then
        ``extra`` (0-d tensors or floats) as floats; returns ``sums``. One device-to-host
        transfer for all of them."""
        sums = {} if sums is None else sums
        for k in self.keys:
            sums.setdefault(k, 0.0)
        tensors = [t for _, _, t, _ in self._passes if t is not None]
        extra_keys = [k for k, v in extra.items() if isinstance(v, torch.Tensor)]
        tensors += [extra[k].detach().reshape(1) for k in extra_keys]
        values = iter(torch.cat(tensors).tolist() if tensors else [])  # the one sync (cat promotes dtypes)
        for weight, names, stacked, floats in self._passes:
            read = dict(zip(names, values)) if stacked is not None else {}
            for k in self.keys:  # keys are visited in the same order as metrics were named
                if k in read or k in floats:
                    sums[k] += (read[k] if k in read else floats[k]) * weight
        read_extra = dict(zip(extra_keys, values))
        sums.update({k: read_extra[k] if k in read_extra else float(v) for k, v in extra.items()})
        return sums


def run_passes(loss: Loss, forward: Forward, samples: list[Sample], advantages: list[float],
               proximal_logprobs: list[list[float]] | None, passes: list[list[int] | None],
               total_tokens: float, filler: Sample | None = None, aux: Aux | None = None) -> PassMetrics:
    """:func:`accumulate` over ``passes`` (index lists into ``samples``; ``None``: a
    weight-0 pass on ``filler``, whose collectives match a busier rank's), each
    weighted by its share of ``total_tokens``, ``aux`` read after each forward. The
    metrics come back unread (a weight-0 pass only names its keys)."""
    out = PassMetrics()
    for idx in passes:
        if idx is None:
            assert filler is not None, "a weight-0 pass needs a filler sample"
            prox = None if proximal_logprobs is None else [[0.0]]
            out.name(accumulate(loss, forward, [filler], [0.0], prox, 0.0, aux))
            continue
        part = [samples[i] for i in idx]
        prox = None if proximal_logprobs is None else [proximal_logprobs[i] for i in idx]
        weight = sum(len(s.response_ids) for s in part) / max(total_tokens, 1)
        out.add(accumulate(loss, forward, part, [advantages[i] for i in idx], prox, weight, aux), weight)
    return out


def accumulate_passes(loss: Loss, forward: Forward, samples: list[Sample], advantages: list[float],
                      proximal_logprobs: list[list[float]] | None, passes: list[list[int] | None],
                      total_tokens: float, sums: dict[str, float], filler: Sample | None = None,
                      aux: Aux | None = None) -> dict[str, float]:
    """:func:`run_passes`, its token-weighted metrics read (one transfer) and added
    into ``sums``, which it returns."""
    return run_passes(loss, forward, samples, advantages, proximal_logprobs, passes, total_tokens, filler,
                      aux).read(sums)
