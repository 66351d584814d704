"""Triton kernels of the chunked LM head's softmax (``trainer.kernels: liger``; CUDA only).

:func:`actors.backends.chunked_logprobs` turns a chunk's ``[C, V]`` logits into each
target's log-prob and the entropy. In torch that is ~6 passes over fp32 copies of the
logits forward (cast, logsumexp, exp, dot) and ~6 backward (cast, sub, exp, mul, cast):
on SmolLM2-135M's head (V = 49152), 64 x ~200-token samples, about a fifth of a graphed
step on an H200. Here each is one pass over the logits in the model's dtype:

    logprob_forward   one program per row: an online max / sum of exp / sum of exp x logit
                      over the row, block by block, in fp32 -> lse, the target's log-prob,
                      entropy = lse - sum(p * logit)
    logprob_backward  one program per row: d logits = g * (onehot(target) - exp(logit - lse)),
                      written over the logits in their dtype (what the head's matmuls take)

The arithmetic is the torch path's (fp32 from the rounded logits), in another order:
equal to it within fp32 rounding.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: chunked_logprobs keeps its torch path
    triton = None

__all__ = ["fused_head_supported", "logprob_backward_", "logprob_forward"]

_BLOCK = 4096  # logits a program reads at a time


def fused_head_supported(logits_device: torch.device, has_bias: bool) -> bool:
    """Triton is installed, the head runs on CUDA and has no bias (whose fp32 gradient needs
    the fp32 d logits the torch path keeps)."""
    return triton is not None and logits_device.type == "cuda" and not has_bias


if triton is not None:

    @triton.jit
    def _forward_kernel(logits_ptr, stride, targets_ptr, lse_ptr, logp_ptr, ent_ptr, V,
                        WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        e = tl.exp(x - m)
        s = tl.sum(e, 0)
        a = tl.sum(tl.where(cols < V, e * x, 0.0), 0)
        for start in range(BLOCK, V, BLOCK):
            c = start + cols
            x = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            scale = tl.exp(m - m_new)
            e = tl.exp(x - m_new)
            s = s * scale + tl.sum(e, 0)
            a = a * scale + tl.sum(tl.where(c < V, e * x, 0.0), 0)
            m = m_new
        lse = m + tl.log(s)
        target = tl.load(targets_ptr + row)
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, tl.load(base + target).to(tl.float32) - lse)
        if WITH_ENTROPY:
            tl.store(ent_ptr + row, lse - a / s)

    @triton.jit
    def _backward_kernel(logits_ptr, stride, targets_ptr, lse_ptr, grad_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        lse = tl.load(lse_ptr + row)
        g = tl.load(grad_ptr + row)
        target = tl.load(targets_ptr + row)
        for start in range(0, V, BLOCK):
            c = start + tl.arange(0, BLOCK)
            x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            d = tl.exp(x - lse) * -g
            d = tl.where(c == target, d + g, d)
            tl.store(base + c, d.to(logits_ptr.dtype.element_ty), mask=c < V)


def logprob_forward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, logprobs: torch.Tensor,
                    entropy: torch.Tensor | None) -> None:
    """From ``logits`` ``[C, V]`` (rows contiguous) and ``targets`` ``[C]``, write fp32 ``lse``,
    ``logprobs`` and, unless None, ``entropy`` (each ``[C]``, contiguous)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    _forward_kernel[(rows,)](logits, logits.stride(0), targets, lse, logprobs,
                             lse if entropy is None else entropy, vocab,
                             WITH_ENTROPY=entropy is not None, BLOCK=_BLOCK, num_warps=8)


def logprob_backward_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                      grad_logprobs: torch.Tensor) -> torch.Tensor:
    """Overwrite ``logits`` ``[C, V]`` with d(sum g * logprob)/d logits, ``g`` =
    ``grad_logprobs`` (fp32 ``[C]``), in the logits' dtype; returns ``logits``."""
    rows, vocab = logits.shape
    if rows:
        _backward_kernel[(rows,)](logits, logits.stride(0), targets, lse, grad_logprobs, vocab,
                                  BLOCK=_BLOCK, num_warps=8)
    return logits
