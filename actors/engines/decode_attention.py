"""Decode attention as one Triton kernel: write the step's K/V into the cache
and attend over it, for every (request, KV head) at once.

Eager decode attention per layer is three launches (two cache writes and a
masked SDPA over the whole preallocated ``max_len``); in a CUDA-graph replay
of a 0.5B model those small kernels, not bandwidth, set the step time. This
kernel is one launch per layer and reads only the positions a request has
written: keys ``< positions[b]`` from the cache, the new key from registers
(it is stored for the next steps, never read back in this one).

One program per (row b, KV head h): its ``G = num_heads / num_kv_heads``
query heads share the key/value stream, as a [G_pad, D] x [D, BLOCK_N] dot
with an online softmax (fp32 accumulation). fp32 inputs use IEEE dot
products (no TF32), so the fp32 contract tests hold to 1e-4.

Only CUDA runs it (``supported()``); the CPU path keeps SDPA.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the SDPA path is used
    triton = None


def supported(device: torch.device, head_dim: int) -> bool:
    """Triton is installed, the device is CUDA and head_dim is a power of two >= 16."""
    return triton is not None and device.type == "cuda" and head_dim >= 16 and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr,
        stride_qb, stride_qh,
        stride_knb, stride_knh,
        stride_vnb, stride_vnh,
        stride_cs, stride_ch, stride_cl,
        stride_ob, stride_oh,
        scale,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + b).to(tl.int32)
        d = tl.arange(0, D)
        g = tl.arange(0, G_PAD)
        n = tl.arange(0, BLOCK_N)
        g_ok = g < G

        # this step's key/value: into the cache for later steps, and kept here
        k_new = tl.load(kn_ptr + b * stride_knb + h * stride_knh + d)
        v_new = tl.load(vn_ptr + b * stride_vnb + h * stride_vnh + d)
        cache = b * stride_cs + h * stride_ch
        tl.store(kc_ptr + cache + pos * stride_cl + d, k_new)
        tl.store(vc_ptr + cache + pos * stride_cl + d, v_new)

        q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None], other=0.0)  # [G_PAD, D]
        # the new key first: it seeds the running max and sum
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale  # [G_PAD]
        l_sum = tl.full([G_PAD], 1.0, tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32) + v_new.to(tl.float32)[None, :]
        for start in range(0, pos, BLOCK_N):
            keys = start + n
            valid = keys < pos
            offs = cache + keys[:, None] * stride_cl + d[None, :]
            k = tl.load(kc_ptr + offs, mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))  # [G_PAD, BLOCK_N]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(vc_ptr + offs, mask=valid[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / l_sum[:, None]
        tl.store(out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [B, Hq, D], k_new / v_new [B, Hkv, D] (any row/head strides, unit last
    stride), caches [slots, Hkv, max_len, D] contiguous, positions [B] ->
    attention output [B, Hq, D]. Writes k_new / v_new at ``positions`` of
    slots ``0..B-1``."""
    B, Hq, D = q.shape
    Hkv = k_new.shape[1]
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} needs a unit last stride")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention: KV caches must be contiguous")
    if D & (D - 1) or D < 16:
        raise ValueError(f"decode_attention: head_dim {D} must be a power of two >= 16")
    G = Hq // Hkv
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _decode_attention_kernel[(B, Hkv)](
        q, k_new, v_new, k_cache, v_cache, positions, out,
        q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        scale,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=64,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
    )
    return out
