"""FP8 block-scaled linears for the built-in engine (``rollout.engine.weight_dtype: fp8``).

    weight  [N, K] ──quantize_blocks──► q [Np, Kp] float8_e4m3fn, scale [Nb, Ls] fp32  (once per push)
    x       [M, K] ──quantize_rows────► q [M, Kp]  float8_e4m3fn, scale [M, Kb]  fp32  (every call)
    y = (x_q · s_x) @ (w_q · s_w)^T      one GEMM on the FP8 tensor cores, bf16 out, sliced to [M, N]

A weight gets one dequantization scale per 128x128 block (``scale = amax / 448``, 448 being
e4m3's largest value); an activation one per token and 128 columns (1x128), the DeepSeek-V3
recipe that cuBLAS runs on Hopper. ``Np`` and ``Kp`` are ``N`` and ``K`` rounded up to whole
blocks: the weight is padded with zeros once, when its buffers are allocated, an activation
as it is quantized, and the output is sliced back to ``N``. ``Nb = Np / 128``, ``Kb = Kp / 128``;
the weight's scale rows are ``Ls = Kb`` rounded up to 4 (cuBLAS reads them as a
``[Ls, Nb]`` K-major matrix), their padding columns hold 1.0 and are never read.

The GEMM, picked once per device by :func:`choose_kernel` (a small probe checked against the
reference; ``statistics()["fp8_kernel"]`` names the choice):

* ``scaled_mm``: ``torch.nn.functional.scaled_mm`` with explicit ``BlockWise1x128`` /
  ``BlockWise128x128`` recipes;
* ``scaled_mm_k512``, ``_scaled_mm``: the same, and ``torch._scaled_mm`` (which infers the
  recipes from the scales' shapes), with ``K`` padded to a multiple of 512 so that the weight's
  scale rows need no padding (``Ls == Kb``): for builds that want them unpadded;
* ``reference``: dequantize both operands, then ``F.linear`` in fp32. Exact about the
  quantization, slow: it is what the CPU tests run and what the kernels are checked against,
  never a fast path. A CUDA device with neither kernel is refused at setup.

A zero block gets a scale from :data:`AMAX_FLOOR`, not 0, so a scale of 0 always means a fault
(:mod:`actors.engines.fp8_store` refuses such a refit).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["AMAX_FLOOR", "BLOCK", "ROWS", "E4M3_MAX", "FP8", "KERNELS", "BlockLayout", "Fp8Linear", "block_faults",
           "choose_kernel", "dequantize_blocks", "dequantize_rows", "linear", "quantize_blocks", "quantize_rows"]

BLOCK = 128
#: The GEMM kernels take activations of a multiple of this many rows (cuBLAS's 1x128 block
#: scaling on an H100, torch 2.11): fewer are padded with zero rows, the output sliced back.
ROWS = 4
FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
#: The smallest block or group maximum a scale is taken from (an all-zero block quantizes to zeros either way).
AMAX_FLOOR = 2.0**-60
#: The GEMM paths, fastest first; ``reference`` is never chosen on CUDA.
KERNELS = ("scaled_mm", "scaled_mm_k512", "_scaled_mm", "reference")
#: Block rows quantized or checked at once (bounds the fp32 temporaries of a push).
_CHUNK_BLOCK_ROWS = 8
_CHOSEN: dict[torch.device, str] = {}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class BlockLayout(NamedTuple):
    """Where a weight [n, k] sits once quantized for ``kernel``: q [np, kp], scale [nb, scale_cols]."""

    n: int
    k: int
    kernel: str

    @property
    def np(self) -> int:
        return _round_up(self.n, BLOCK)

    @property
    def kp(self) -> int:
        return _round_up(self.k, 4 * BLOCK if self.kernel in ("scaled_mm_k512", "_scaled_mm") else BLOCK)

    @property
    def nb(self) -> int:
        return self.np // BLOCK

    @property
    def kb(self) -> int:
        return self.kp // BLOCK

    @property
    def scale_cols(self) -> int:
        return _round_up(self.kb, 4)


class Fp8Linear(NamedTuple):
    """A quantized weight as the forward passes it (in place of a bf16 weight tensor): views of
    buffers allocated once, so captured CUDA graphs read what a push writes into them."""

    weight: torch.Tensor  # [np, kp] float8_e4m3fn
    scale: torch.Tensor  # [nb, scale_cols] fp32, dequantization scales of 128x128 blocks
    out_features: int  # n
    in_features: int  # k
    kernel: str  # one of KERNELS


@torch.no_grad()
def quantize_blocks(w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """Quantize ``w`` [n, k] into ``q_out`` [np, kp] (zero padded) and ``scale_out`` [nb, scale_cols]
    (one dequantization scale per 128x128 block, the padding columns 1.0), in place."""
    n, k = w.shape
    np_, kp = q_out.shape
    nb, kb = np_ // BLOCK, kp // BLOCK
    assert np_ >= n and kp >= k and np_ % BLOCK == 0 and kp % BLOCK == 0, (w.shape, q_out.shape)
    assert scale_out.shape[0] == nb and scale_out.shape[1] >= kb, (scale_out.shape, nb, kb)
    for r0 in range(0, nb, _CHUNK_BLOCK_ROWS):
        r1 = min(nb, r0 + _CHUNK_BLOCK_ROWS)
        rows = w[r0 * BLOCK : r1 * BLOCK].float()
        blocks = F.pad(rows, (0, kp - k, 0, (r1 - r0) * BLOCK - rows.shape[0])).view(r1 - r0, BLOCK, kb, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp_min_(AMAX_FLOOR).div_(E4M3_MAX)  # [r1 - r0, kb]
        q = (blocks / scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        q_out[r0 * BLOCK : r1 * BLOCK].copy_(q.view(-1, kp))
        scale_out[r0:r1, :kb].copy_(scale)
    scale_out[:, kb:].fill_(1.0)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, n: int | None = None, k: int | None = None) -> torch.Tensor:
    """``q`` [np, kp] times its block scales, fp32, sliced to [n, k] (default: all of it)."""
    np_, kp = q.shape
    nb, kb = np_ // BLOCK, kp // BLOCK
    x = q.float().view(nb, BLOCK, kb, BLOCK) * scale[:, None, :kb, None]
    return x.view(np_, kp)[: np_ if n is None else n, : kp if k is None else k]


def quantize_rows(x: torch.Tensor, kp: int, mp: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (q [mp, kp] float8_e4m3fn, zero padded; scale [mp, kp / 128] fp32): one scale per
    token and 128 columns, laid out outer-dim-major (strides (1, mp)) as cuBLAS reads it. ``mp``
    (default m): rows padded with zeros (cuBLAS's block scaling takes a multiple of 4 rows).
    No clamp before the cast: |x| / (amax / 448) rounds to at most 448 (e4m3 rounds values up
    to 464 down to 448), and a floored scale only meets zeros."""
    m, k = x.shape
    mp = m if mp is None else mp
    if kp != k or mp != m:
        x = F.pad(x, (0, kp - k, 0, mp - m))
    m = mp
    groups = x.reshape(m, kp // BLOCK, BLOCK)
    amax = torch.linalg.vector_norm(groups, float("inf"), dim=-1, dtype=torch.float32)  # [m, kb]
    scale = amax.clamp_min_(AMAX_FLOOR).div_(E4M3_MAX)
    q = (groups / scale.unsqueeze(-1)).to(FP8)
    return q.view(m, kp), scale.t().contiguous().t()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 activation [m, kp] that :func:`quantize_rows` encoded."""
    m, kp = q.shape
    return (q.float().view(m, kp // BLOCK, BLOCK) * scale.unsqueeze(-1)).view(m, kp)


def linear(x: torch.Tensor, w: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for the quantized ``W`` of ``w``: x [..., k] -> [..., n] in x's dtype,
    the activation quantized 1x128 on the way in (by ``w.kernel``'s path)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    m = x2.shape[0]
    xq, xs = quantize_rows(x2, w.weight.shape[1], None if w.kernel == "reference" else _round_up(m, ROWS))
    if w.kernel.startswith("scaled_mm"):
        out = F.scaled_mm(xq, w.weight.t(), xs, F.ScalingType.BlockWise1x128, w.scale.t(),
                          F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    elif w.kernel == "_scaled_mm":
        out = torch._scaled_mm(xq, w.weight.t(), xs, w.scale.t(), out_dtype=x.dtype)
    else:
        out = reference_matmul(xq, xs, w).to(x.dtype)
    if out.shape != (m, w.out_features):
        out = out[:m, : w.out_features]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, w.out_features)


def reference_matmul(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Linear) -> torch.Tensor:
    """The reference path: both operands dequantized, one fp32 matmul -> [m, np] fp32."""
    return F.linear(dequantize_rows(xq, xs), dequantize_blocks(w.weight, w.scale))


def block_faults(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[nb, kb] bool, on ``w``'s device: the blocks whose scale is not finite and positive, or whose
    dequantized values stray more than ``amax * 2**-3`` from ``w`` [n, k] (e4m3 rounds within
    ``2**-4`` of a value: a block over the bound holds stale data or a stale scale)."""
    n, k = w.shape
    np_, kp = q.shape
    nb, kb = np_ // BLOCK, kp // BLOCK
    s = scale[:, :kb]
    out = ~(torch.isfinite(s) & (s > 0))
    for r0 in range(0, nb, _CHUNK_BLOCK_ROWS):
        r1 = min(nb, r0 + _CHUNK_BLOCK_ROWS)
        rows = w[r0 * BLOCK : r1 * BLOCK].float()
        want = F.pad(rows, (0, kp - k, 0, (r1 - r0) * BLOCK - rows.shape[0])).view(r1 - r0, BLOCK, kb, BLOCK)
        got = dequantize_blocks(q[r0 * BLOCK : r1 * BLOCK], scale[r0:r1]).view(r1 - r0, BLOCK, kb, BLOCK)
        err = (got - want).abs().amax(dim=(1, 3))
        bound = want.abs().amax(dim=(1, 3)) * 2.0**-3
        out[r0:r1] |= ~(err <= bound)  # NaN errors count as faults
    return out


def choose_kernel(device: torch.device) -> str:
    """The GEMM path for FP8 linears on ``device`` (cached): ``reference`` off CUDA; on CUDA the
    first of :data:`KERNELS` but the reference that runs a small probe and matches the reference.
    Raises ``RuntimeError`` naming what each refused when neither does."""
    device = torch.device(device)
    if device.type != "cuda":
        return "reference"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _CHOSEN:
        failures = []
        for kernel in KERNELS[:-1]:
            try:
                _probe(kernel, device)
            except Exception as exc:  # noqa: BLE001 - every failure is reported below, none is silent
                failures.append(f"{kernel}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            _CHOSEN[device] = kernel
            break
        else:
            raise RuntimeError(f"weight_dtype fp8: no FP8 GEMM with 1x128/128x128 block scales runs on {device} "
                               f"(torch {torch.__version__}; needs SM90 and cuBLAS >= 12.9): {'; '.join(failures)}")
    return _CHOSEN[device]


@torch.no_grad()
def _probe(kernel: str, device: torch.device) -> None:
    """Run ``kernel`` on a padded shape and compare it with the reference; raises when it differs."""
    if kernel.startswith("scaled_mm") and not hasattr(F, "scaled_mm"):
        raise RuntimeError(f"torch.nn.functional.scaled_mm is not in torch {torch.__version__}")
    gen = torch.Generator(device=device).manual_seed(0)
    n, k = 256, 640  # k: 5 blocks, not a multiple of 4 blocks, as a 576-wide model has
    layout = BlockLayout(n, k, kernel)
    w = torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16)
    q = torch.empty(layout.np, layout.kp, dtype=FP8, device=device)
    s = torch.empty(layout.nb, layout.scale_cols, dtype=torch.float32, device=device)
    quantize_blocks(w, q, s)
    lin = Fp8Linear(q, s, n, k, kernel)
    for m in (1, 5, 64):
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        got = linear(x, lin).float()
        want = linear(x, lin._replace(kernel="reference")).float()
        err, top = (got - want).abs().max().item(), want.abs().max().item()
        if not err <= 2e-2 * top + 1e-3:
            raise RuntimeError(f"wrong result at m={m}: max error {err:.3g} against a largest value {top:.3g}")
