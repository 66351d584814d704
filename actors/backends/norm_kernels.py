"""Triton RMSNorm with a row-blocked backward (``trainer.kernels: liger``; CUDA only).

Liger's RMSNorm backward launches one program per SM, each walking its rows one at a time:
on SmolLM2-135M (hidden 576, ~12,800 packed rows a micro-batch, bf16) that is ~97 dependent
row loads a program, a visible share of a graphed step (docs/benchmarks.md, "Trainer
step"). Here both passes take a tile of rows at a time, ``[BLOCK_M, next_pow2(H)]``:

    forward    per row: rstd = rsqrt(mean(x^2) + eps) in fp32 (kept for the backward),
               y = w * (x * rstd).to(x's dtype), the product rounded once to x's dtype
    backward   per tile: dx for its rows, and its rows' share of dW summed in fp32 into a
               ``[programs, H]`` fp32 buffer that torch sums over programs

The arithmetic is Hugging Face's LlamaRMSNorm (``weight * hidden_states.to(input_dtype)``) and
what torch's autograd does with it, rounding where it rounds (``x_hat``, ``dy * w``) and summing
in fp32 where it sums: the forward equals eager's within fp32 rounding of rstd (bf16: at most an
ulp), the gradients within fp32 rounding (dW: eager rounds each ``dy * x_hat`` to the dtype
before summing; here the sum is fp32 from the exact products). Only Llama-style norms are
patched: Gemma's ``(1 + w)`` and Olmo2's fp32 ``w * x_hat`` round elsewhere.
"""

from __future__ import annotations

import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the norms keep their forwards
    triton = None

__all__ = ["RMSNormFunction", "patch_rms_norms", "rms_norm"]

_MAX_H = 8192  # one row's tile in registers
_TILE = 4096  # elements a program takes at a time: BLOCK_M = _TILE // next_pow2(H) rows, at least 1
_MAX_PROGRAMS = 2048  # backward programs at most (rows beyond loop); bounds the [programs, H] dW buffer
_WARPS = 8  # warps a program
# Norms whose forward is LlamaRMSNorm's (checked against transformers 5.25's sources), and Liger's
# own class, whose instances say how they round (offset 0, casting "llama" is this one).
_LLAMA_STYLE = frozenset(f"{family}RMSNorm" for family in (
    "Llama", "Mistral", "Mixtral", "Ministral", "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe", "Phi3", "Granite",
    "SmolLM3", "Glm4", "DeepseekV3", "Exaone4", "Liger"))


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, x_stride, w_ptr, y_ptr, rstd_ptr, rows, H, eps,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.arange(0, BLOCK_N)
        mask = (r < rows)[:, None] & (c < H)[None, :]
        x = tl.load(x_ptr + r[:, None] * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / H + eps)
        x_hat = (x * rstd[:, None]).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + c, mask=c < H, other=0.0)
        # the product of two values of the dtype is exact in fp32: one rounding, as torch's
        y = w.to(tl.float32)[None, :] * x_hat.to(tl.float32)
        tl.store(y_ptr + r[:, None] * H + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + r, rstd, mask=r < rows)

    @triton.jit
    def _backward_kernel(dy_ptr, dy_stride, x_ptr, x_stride, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, H,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        c = tl.arange(0, BLOCK_N)
        w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(pid * BLOCK_M, rows, tl.num_programs(0) * BLOCK_M):
            r = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
            mask = (r < rows)[:, None] & (c < H)[None, :]
            x = tl.load(x_ptr + r[:, None] * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r[:, None] * dy_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + r, mask=r < rows, other=0.0)  # 0 on rows past the end: all terms 0
            x_hat = x * rstd[:, None]
            # y = w * x_hat.to(dtype): dW sums dy * the rounded x_hat; d x_hat = dy * w, rounded as torch's
            dw += tl.sum(dy * x_hat.to(dx_ptr.dtype.element_ty).to(tl.float32), 0)
            g = (dy * w[None, :]).to(dx_ptr.dtype.element_ty).to(tl.float32)
            # x_hat = x * rsqrt(mean(x^2) + eps): dx = rstd * (g - x_hat * mean(g * x_hat))
            dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, 1) / H)[:, None])
            tl.store(dx_ptr + r[:, None] * H + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + pid * H + c, dw, mask=c < H)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, H]`` with unit column stride (a copy only if it has none)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _blocks(hidden: int) -> tuple[int, int]:
    block_n = triton.next_power_of_2(hidden)
    return max(1, _TILE // block_n), block_n


class RMSNormFunction(torch.autograd.Function):
    """``y = weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`` over ``x``'s last dim, as
    LlamaRMSNorm computes it; ``weight`` ``[H]`` of ``x``'s dtype, ``H`` at most 8192."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        hidden = x.shape[-1]
        if weight.shape != (hidden,) or weight.dtype != x.dtype or hidden > _MAX_H:
            raise ValueError(f"rms_norm takes x [..., H <= {_MAX_H}] and weight [H] of x's dtype; "
                             f"got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
        x2, weight = _rows(x), weight.contiguous()
        rows = x2.shape[0]
        y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            block_m, block_n = _blocks(hidden)
            _forward_kernel[(triton.cdiv(rows, block_m),)](x2, x2.stride(0), weight, y, rstd, rows, hidden, eps,
                                                           BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_WARPS)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        rows, hidden = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
        block_m, block_n = _blocks(hidden)
        programs = max(1, min(triton.cdiv(rows, block_m), _MAX_PROGRAMS))
        dw = torch.empty((programs, hidden), dtype=torch.float32, device=x2.device)  # every program writes its row
        if rows:
            _backward_kernel[(programs,)](dy2, dy2.stride(0), x2, x2.stride(0), weight, rstd, dx, dw, rows, hidden,
                                          BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_WARPS)
        return dx.view(dy.shape), dw.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward, ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, in Triton."""
    return RMSNormFunction.apply(x, weight, eps)


def _norm_eps(module: torch.nn.Module) -> float | None:
    """``module``'s epsilon if it is a Llama-style RMSNorm on CUDA this module can run, else None."""
    name, weight = type(module).__name__, getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    eps = getattr(module, "eps", None) if eps is None else eps
    if (name not in _LLAMA_STYLE or not isinstance(weight, torch.Tensor) or weight.dim() != 1
            or weight.device.type != "cuda" or weight.shape[0] > _MAX_H or not isinstance(eps, (int, float))
            or getattr(module.forward, "triton_rms_norm", False)):  # patched before
        return None
    # Liger's patch (and its class) keep the norm's offset and rounding on the instance: Gemma's is 1 / "gemma"
    if getattr(module, "offset", 0.0) != 0.0 or getattr(module, "casting_mode", "llama") != "llama":
        return None
    return float(eps)


def patch_rms_norms(model: torch.nn.Module) -> int:
    """Point the ``forward`` of each Llama-style RMSNorm in ``model`` on CUDA (Liger-patched or
    not) at :func:`rms_norm`; how many (0 without Triton). A call whose input is not of the
    weight's dtype runs the forward the norm had."""
    if triton is None:
        return 0
    patched = 0
    for module in model.modules():
        eps = _norm_eps(module)
        if eps is None:
            continue
        before = module.forward  # the class's, or the one Liger bound to the instance

        def forward(self, hidden_states, _before=before, _eps=eps):
            if hidden_states.dtype != self.weight.dtype:
                return _before(hidden_states)
            return rms_norm(hidden_states, self.weight, _eps)

        forward.triton_rms_norm = True
        module.forward = types.MethodType(forward, module)
        patched += 1
    return patched
