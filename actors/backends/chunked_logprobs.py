"""Log-probs of target tokens from the LM head, a chunk of tokens at a time.

    hidden [T, H] (the body's output at the positions that predict the targets)
        ─► per chunk of C tokens: logits = hidden_c @ W^T (+ b) in the model dtype ─► fp32 [C, V]
        ─► log-prob of each target = logit[target] - logsumexp, entropy = logsumexp - sum(p * logit)
    backward, per chunk: recompute the chunk's logits, d logp / d logits = onehot(target) - p,
        grad hidden_c = d @ W, grad W += d^T @ hidden_c (accumulated in fp32)

Only one chunk's ``[C, V]`` logits exist at a time, forward or backward, instead
of fp32 logits for every position of the micro-batch; the cost is one more
head matmul in the backward (the recompute). The numbers are those of
``log_softmax(hidden @ W^T)`` (the logits rounded to the model dtype first, as
the model's own head does). A tied head works unchanged: its weight is the
embedding's parameter and autograd adds both gradients. Entropy is a metric:
no gradient flows through it. ``fused`` (``trainer.kernels: liger``) runs the
softmax part of each chunk as one Triton pass over the logits in the model dtype,
forward and backward (:mod:`actors.backends.head_kernels`), where it can run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from actors.backends import head_kernels

__all__ = ["chunked_logprobs"]


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits ``[C, V]`` of a chunk, computed in the model dtype as its head would."""
    return F.linear(hidden, weight, bias).float()


class _ChunkedLogProbs(torch.autograd.Function):
    """Log-probs ``[T]`` (differentiable in hidden, weight and bias) and entropy ``[T]`` (not)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens, with_entropy, fused):
        num_tokens = hidden.shape[0]
        fused = fused and head_kernels.fused_head_supported(hidden.device, bias is not None)
        logprobs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.empty(num_tokens if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, num_tokens, chunk_tokens):
            e = min(s + chunk_tokens, num_tokens)
            if fused:
                head_kernels.logprob_forward(F.linear(hidden[s:e], weight), targets[s:e], lse[s:e], logprobs[s:e],
                                             entropy[s:e] if with_entropy else None)
                continue
            logits = _chunk_logits(hidden[s:e], weight, bias)  # [C, V]
            # out=: straight into the [T] results, no per-chunk temporaries copied over
            torch.logsumexp(logits, dim=-1, out=lse[s:e])
            torch.sub(logits.gather(1, targets[s:e, None]).squeeze(1), lse[s:e], out=logprobs[s:e])
            if with_entropy:
                probs = torch.sub(logits, lse[s:e, None]).exp_()  # one [C, V] temporary, not two
                torch.sub(lse[s:e], torch.linalg.vecdot(probs, logits), out=entropy[s:e])
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_tokens, ctx.fused = chunk_tokens, fused
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        grad_logprobs = grad_logprobs.float().contiguous()  # a column of the head's [T, 2] output's grad
        for s in range(0, hidden.shape[0], ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, hidden.shape[0])
            if ctx.fused:  # d in the model dtype, over the recomputed logits
                d = head_kernels.logprob_backward_(F.linear(hidden[s:e], weight), targets[s:e], lse[s:e],
                                                   grad_logprobs[s:e])
            else:
                d = _softmax_grad(_chunk_logits(hidden[s:e], weight, bias), targets[s:e], lse[s:e],
                                  grad_logprobs[s:e, None])
                if need_b:
                    grad_b += d.sum(0)
                d = d.to(hidden.dtype)
            if need_h:
                grad_h[s:e] = d @ weight
            if need_w:
                grad_w += d.t() @ hidden[s:e]
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


def _softmax_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d(g * logp[target]) / d logits = g * (onehot(target) - softmax), in place on fp32 ``logits``."""
    d = logits.sub_(lse[:, None]).exp_().mul_(-g)
    return d.scatter_add_(1, targets[:, None], g)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     chunk_tokens: int, with_entropy: bool = True,
                     fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets[t]`` ``[T]`` under ``softmax(hidden[t] @ weight^T + bias)`` (fp32),
    and the distribution's entropy ``[T]`` (empty when not ``with_entropy``), from ``hidden``
    ``[T, H]`` and the head ``weight`` ``[V, H]``, ``chunk_tokens`` rows of logits at a time;
    ``fused``: through the Triton kernels where they can run (CUDA, no bias), else as without."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.ndim != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [T, H] and targets [T]; got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    return _ChunkedLogProbs.apply(hidden, weight, bias, targets, chunk_tokens, with_entropy, fused)

