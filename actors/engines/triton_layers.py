"""Triton kernels for the matmuls of a small-batch decode step (CUDA).

At batch <= 64 a decode step of a 0.5B model is latency-bound: the weights
of a layer are read once (~30 MB), yet cuBLAS spends about three times the
time of that read on its four GEMMs, and more on the norms, SwiGLU and residual adds
around them (``bench/results/engine/engine_notes.md``). These kernels cut a layer
to six launches and let the weight stream use the whole GPU:

    qkv   = x @ Wqkv^T + b                     ``linear``            one launch
    attention (triton_kernels.decode_attention)                       one launch
    part  = attn @ Wo^T, K cut into S pieces   ``linear_partials``   one launch
    h, x  = h + sum(part), rms_norm(h)         ``add_rms_norm``      one launch
    act   = silu(x @ Wg^T) * (x @ Wu^T)        ``gate_up_silu``      one launch
    part  = act @ Wd^T, K cut into S pieces    ``linear_partials``   one launch
    (the next layer's ``add_rms_norm`` adds these partials to h)

Split-K spreads a GEMM with few output columns (o_proj, down: N = hidden)
over enough programs to keep every SM streaming weights; its fp32 partial
sums are added in a fixed order by the norm kernel that follows, so results
are deterministic (no atomics) and no separate reduce launch is needed.

Numerics follow the model-dtype forward: each linear's output is rounded to
the model dtype before it is added to the residual, the residual is kept in
the model dtype, the norm is computed in fp32.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path is used
    triton = None

MAX_ROWS = 64  # one tile of rows: larger batches take the cuBLAS path


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA with Triton; bf16 / fp16, and fp32 (IEEE products: the fp32 contract tests run this path)."""
    return triton is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_start():
        """Programmatic dependent launch: let the next kernel's programs get resident now,
        then wait until the previous kernel has finished and its writes are visible. Every
        read and write of this kernel comes after the wait, so the overlap hides only the
        launch of each kernel, never reorders memory."""
        gdc_launch_dependents()
        gdc_wait()

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_split,
                       stride_xm, stride_wn, stride_om, stride_os,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                       PARTIAL: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        """Program (n-tile, k-piece): out[:, tile] = x[:, piece] @ w[tile, piece]^T.
        GATED: w holds gate rows [0, N) then up rows [N, 2N); out = silu(gate) * up.
        PARTIAL: fp32 partial sums at out[piece] (no bias, no rounding)."""
        pid_n = tl.program_id(0)
        piece = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        k_lo = piece * k_split  # k_split: a multiple of BLOCK_K
        if PDL:
            pdl_start()
        x_at = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
        w_at = w_ptr + rn[:, None] * stride_wn + (k_lo + rk)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_split, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_at + k, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_at + k, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = (k_lo + k + rk) < K
                x = tl.load(x_at + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_at + k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:  # fp32 models (tests): exact products, no TF32
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                if EVEN_K:
                    u = tl.load(w_at + N * stride_wn + k, mask=n_ok[:, None], other=0.0)
                else:
                    u = tl.load(w_at + N * stride_wn + k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if IEEE:
                    acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(x, tl.trans(u), acc_up)
        ok = m_ok[:, None] & n_ok[None, :]
        if PARTIAL:
            tl.store(out_ptr + piece * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=ok)
        else:
            dtype = out_ptr.dtype.element_ty
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:  # the gate and up projections' outputs in the model dtype, as the torch path rounds them
                gate = acc.to(dtype).to(tl.float32)
                act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
                acc = act * acc_up.to(dtype).to(tl.float32)
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(dtype), mask=ok)

    @triton.jit
    def _add_rms_norm_kernel(part_ptr, pieces, h_ptr, w_ptr, x_ptr, N, eps,
                             stride_ps, stride_pm, stride_hm, stride_xm,
                             BLOCK: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
        """Row m: h += round(sum of the pieces' partials) (ADD), then x = rms_norm(h) * w."""
        if PDL:
            pdl_start()
        m = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < N
        dtype = h_ptr.dtype.element_ty
        h = tl.load(h_ptr + m * stride_hm + c, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            y = tl.zeros([BLOCK], dtype=tl.float32)
            for s in range(pieces):
                y += tl.load(part_ptr + s * stride_ps + m * stride_pm + c, mask=ok, other=0.0)
            h = (h + y.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            tl.store(h_ptr + m * stride_hm + c, h.to(dtype), mask=ok)
        var = tl.sum(h * h, axis=0) / N
        x = h * tl.rsqrt(var + eps)
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(x_ptr + m * stride_xm + c, (x * w).to(dtype), mask=ok)


class Tiling:
    """Tile sizes of one GEMM shape: BLOCK_N output columns x BLOCK_K per step, K cut in ``pieces``."""

    __slots__ = ("block_n", "block_k", "pieces", "num_warps", "num_stages")

    def __init__(self, block_n: int, block_k: int, pieces: int, num_warps: int = 4, num_stages: int = 4):
        self.block_n, self.block_k, self.pieces = block_n, block_k, pieces
        self.num_warps, self.num_stages = num_warps, num_stages

    def __repr__(self) -> str:
        return f"Tiling(n={self.block_n}, k={self.block_k}, pieces={self.pieces}, warps={self.num_warps}, stages={self.num_stages})"


_SM_COUNT: dict[int, int] = {}
# Programmatic dependent launch (Hopper and later): ``None`` = on where the GPU has it;
# ``ASYNCRL_PDL=0`` or ``PDL = False`` turns it off (``bench.engine`` measures both).
PDL: bool | None = None if os.environ.get("ASYNCRL_PDL", "1") != "0" else False


def pdl(device: torch.device) -> bool:
    if PDL is not None or device.type != "cuda":
        return bool(PDL) and device.type == "cuda"
    return torch.cuda.get_device_capability(device)[0] >= 9


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (8 elsewhere: the Triton interpreter in tests)."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def default_tiling(n: int, k: int, device: torch.device, gated: bool = False, split: bool = True) -> Tiling:
    """Narrow column tiles, then K cut into pieces (only where the caller adds partials:
    ``split``) until about one program per SM."""
    # From the H200 sweep of ``bench.decode_layers`` (Qwen2.5-0.5B shapes, 64 rows): long K
    # streams best in 256-wide steps; the gated MLP in 64-column tiles (two weight tiles a step);
    # split GEMMs in about one program per SM.
    sms = sm_count(device)
    if gated:
        return Tiling(64, 128 if k >= 128 else 64, 1)
    block_k = 256 if k >= 2048 or (not split and k >= 512) else 128 if k >= 128 else 64
    block_n = 32 if split and k >= 2048 else 16
    tiles = triton.cdiv(n, block_n)
    pieces = 1
    steps = triton.cdiv(k, block_k)
    if split:
        while tiles * pieces * 2 <= sms and steps // (pieces * 2) >= 2:
            pieces *= 2
    return Tiling(block_n, block_k, pieces)


def _block_m(m: int) -> int:
    if m > MAX_ROWS:
        raise ValueError(f"triton_layers: {m} rows (at most {MAX_ROWS})")
    return max(16, triton.next_power_of_2(m))


def _split(k: int, tiling: Tiling, partial: bool) -> tuple[int, int]:
    """(elements of K per piece, a multiple of BLOCK_K; number of pieces)."""
    k_split = triton.cdiv(triton.cdiv(k, tiling.pieces if partial else 1), tiling.block_k) * tiling.block_k
    return k_split, triton.cdiv(k, k_split)


def _launch(x, w, bias, out, n, tiling: Tiling, gated: bool, partial: bool) -> None:
    m, k = x.shape
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("triton_layers: x and w need a unit last stride")
    k_split, pieces = _split(k, tiling, partial)
    grid = (triton.cdiv(n, tiling.block_n), pieces)
    on = pdl(x.device)
    _linear_kernel[grid](
        x, w, bias if bias is not None else x, out, m, n, k, k_split,
        x.stride(0), w.stride(0), out.stride(-2), out.stride(0) if partial else 0,
        BLOCK_M=_block_m(m), BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, EVEN_K=k % k_split == 0,
        HAS_BIAS=bias is not None, GATED=gated, PARTIAL=partial, IEEE=x.dtype == torch.float32, PDL=on,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages, launch_pdl=on,
    )


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, tiling: Tiling | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias) -> [M, N] in x's dtype (M <= 64)."""
    n = w.shape[0]
    tiling = tiling or default_tiling(n, x.shape[1], x.device, split=False)
    out = torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
    _launch(x, w, bias, out, n, tiling, gated=False, partial=False)
    return out


def gate_up_silu(x: torch.Tensor, gate_up_w: torch.Tensor, tiling: Tiling | None = None) -> torch.Tensor:
    """x [M, K], gate_up_w [2I, K] (gate rows, then up rows) -> silu(x Wg^T) * (x Wu^T) [M, I]."""
    n = gate_up_w.shape[0] // 2
    tiling = tiling or default_tiling(n, x.shape[1], x.device, gated=True, split=False)
    out = torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
    _launch(x, gate_up_w, None, out, n, tiling, gated=True, partial=False)
    return out


def linear_partials(x: torch.Tensor, w: torch.Tensor, tiling: Tiling | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T as fp32 partial sums over K pieces: [pieces, M, N]
    (their sum is the product; ``add_rms_norm`` adds them)."""
    m, k = x.shape
    n = w.shape[0]
    tiling = tiling or default_tiling(n, k, x.device)
    out = torch.empty((_split(k, tiling, True)[1], m, n), device=x.device, dtype=torch.float32)
    _launch(x, w, None, out, n, tiling, gated=False, partial=True)
    return out


def add_rms_norm(partials: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h [M, N] += sum over pieces of ``partials`` [pieces, M, N] (rounded to h's dtype
    first), in place; returns rms_norm(h) * weight [M, N]. ``partials`` None: the norm only."""
    m, n = h.shape
    if h.stride(-1) != 1:
        raise ValueError("triton_layers.add_rms_norm: h needs a unit last stride")
    x = torch.empty_like(h)
    add = partials is not None
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(m,)](
        partials if add else h, partials.shape[0] if add else 0, h, weight, x, n, eps,
        partials.stride(0) if add else 0, partials.stride(1) if add else 0, h.stride(0), x.stride(0),
        BLOCK=block, ADD=add, num_warps=4 if block <= 2048 else 8, PDL=pdl(h.device), launch_pdl=pdl(h.device),
    )
    return x
