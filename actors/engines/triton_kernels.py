"""Triton kernels of the decode step (CUDA only; CPU keeps the torch paths).

``decode_attention``: write the step's K/V into the cache and attend over it,
for every (request, KV head) at once, in one launch.

``sample_gumbel``: temperature sampling of [B, V] logits (no top-k / top-p,
unseeded rows) with the sampled token's log-probs, in two launches.

Decode attention:

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

Only CUDA runs it (``attention_supported()``); the CPU path keeps SDPA.

Sampling: the eager version is ~10 passes over the fp32 [B, V] logits (noise,
log, add, argmax, logsumexp, ...), about a fifth of a small model's forward
at B=64, V=152k. Here each row is cut into ``_CHUNKS``
pieces; one program per (row, piece) reads its logits once (bf16 or fp32)
and keeps, per lane, online log-sum-exps (raw and temperature-scaled) and
the best Gumbel score ``x / T - log(-log(u))`` with ``u`` from Triton's
counter-based Philox (seeded per call from the engine's generator); a second
launch merges the pieces. Gumbel-max draws exactly from softmax(x / T).
"""

from __future__ import annotations

import torch

from actors.engines import triton_layers

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the SDPA path is used
    triton = None

if triton is not None:
    from actors.engines.triton_layers import pdl_start


def attention_supported(device: torch.device, head_dim: int) -> bool:
    """Triton is installed, the device is CUDA and head_dim is a power of two >= 16."""
    return triton is not None and device.type == "cuda" and head_dim >= 16 and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, cos_ptr, sin_ptr, part_ptr,
        stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh,
        stride_cs, stride_ch, stride_cl, stride_ob, stride_oh, stride_rope,
        scale, split_len, splits,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # reads and writes all come after the previous kernel finished (triton_layers.pdl_start)
            pdl_start()
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        pos = tl.load(pos_ptr + b).to(tl.int32)
        d = tl.arange(0, D)
        g = tl.arange(0, G_PAD)
        n = tl.arange(0, BLOCK_N)
        g_ok = g < G

        k_new = tl.load(kn_ptr + b * stride_knb + h * stride_knh + d)
        v_new = tl.load(vn_ptr + b * stride_vnb + h * stride_vnh + d)
        q_at = q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh
        q = tl.load(q_at + d[None, :], mask=g_ok[:, None], other=0.0)  # [G_PAD, D]
        if ROPE:  # x * cos + rotate_half(x) * sin, in fp32, for q and the new key
            half: tl.constexpr = D // 2
            d_sw = tl.where(d < half, d + half, d - half)
            sign = tl.where(d < half, -1.0, 1.0)
            cos = tl.load(cos_ptr + pos * stride_rope + d).to(tl.float32)
            sin = tl.load(sin_ptr + pos * stride_rope + d).to(tl.float32) * sign
            k_sw = tl.load(kn_ptr + b * stride_knb + h * stride_knh + d_sw).to(tl.float32)
            k_new = (k_new.to(tl.float32) * cos + k_sw * sin).to(k_new.dtype)
            q_sw = tl.load(q_at + d_sw[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * cos[None, :] + q_sw * sin[None, :]).to(q.dtype)
        # this step's key/value: into the cache for later steps, and kept here
        cache = b * stride_cs + h * stride_ch
        first = split == 0
        if first:
            tl.store(kc_ptr + cache + pos * stride_cl + d, k_new)
            tl.store(vc_ptr + cache + pos * stride_cl + d, v_new)

        # split 0 takes the new key first: it seeds the running max and sum
        m = tl.where(first, tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale,
                     float("-inf"))  # [G_PAD]
        l_sum = tl.where(first, tl.full([G_PAD], 1.0, tl.float32), 0.0)
        acc = tl.zeros([G_PAD, D], tl.float32) + tl.where(first, v_new.to(tl.float32), 0.0)[None, :]
        lo = split * split_len
        hi = tl.minimum(lo + split_len, pos)
        for start in range(lo, hi, BLOCK_N):
            keys = start + n
            valid = keys < hi
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
        if splits == 1:
            out = acc / l_sum[:, None]
            tl.store(out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:  # partial (acc, max, sum) per query head: [B, Hq, splits, D + 2] fp32
            at = part_ptr + (((b * tl.num_programs(1) + h) * G + g) * splits + split) * (D + 2)
            tl.store(at[:, None] + d[None, :], acc, mask=g_ok[:, None])
            tl.store(at + D, m, mask=g_ok)
            tl.store(at + D + 1, l_sum, mask=g_ok)

    @triton.jit
    def _decode_attention_merge_kernel(part_ptr, out_ptr, stride_ob, stride_oh, splits,
                                       D: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            pdl_start()
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, D)
        ok = s < splits
        at = part_ptr + ((b * tl.num_programs(1) + h) * splits + s) * (D + 2)
        m = tl.load(at + D, mask=ok, other=float("-inf"))  # split 0 always holds the new key: max is finite
        w = tl.exp(m - tl.max(m, 0))  # an empty split (m = -inf) weighs 0
        total = tl.sum(tl.load(at + D + 1, mask=ok, other=0.0) * w, 0)
        acc = tl.load(at[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / total
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """q [B, Hq, D], k_new / v_new [B, Hkv, D] (any row/head strides, unit last
    stride), caches [slots, Hkv, max_len, D] contiguous, positions [B] ->
    attention output [B, Hq, D]. Writes k_new / v_new at ``positions`` of
    slots ``0..B-1``. With ``cos`` / ``sin`` tables [max_len, D], q and
    k_new come without RoPE and the kernel applies it at ``positions``."""
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
    out = torch.empty((B, Hq, D), device=q.device, dtype=q.dtype)
    pdl = triton_layers.pdl(q.device)
    rope = cos is not None
    if rope and not (cos.stride(-1) == 1 and cos.stride() == sin.stride()):
        raise ValueError("decode_attention: cos / sin tables need the same strides and a unit last one")
    # flash-decoding: cut each row's keys into splits when (row, KV head) programs alone
    # would leave SMs idle; a second launch merges the splits' partial softmaxes
    max_len = k_cache.shape[2]
    # the split count is a runtime argument: batch sizes come and go without recompiles
    splits = min(-(-_target_programs(q.device) // (B * Hkv)), -(-max_len // _ATT_BLOCK_N), _MAX_SPLITS)
    split_len = -(-(-(-max_len // splits)) // _ATT_BLOCK_N) * _ATT_BLOCK_N
    splits = -(-max_len // split_len)
    part = torch.empty((B, Hq, splits, D + 2), device=q.device, dtype=torch.float32) if splits > 1 else out
    _decode_attention_kernel[(B, Hkv, splits)](
        q, k_new, v_new, k_cache, v_cache, positions, out, cos if rope else q, sin if rope else q, part,
        q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), cos.stride(0) if rope else 0,
        scale, split_len, splits,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=_ATT_BLOCK_N,
        IEEE=q.dtype == torch.float32, ROPE=rope,
        num_warps=_ATT_WARPS, num_stages=_ATT_STAGES, PDL=pdl, launch_pdl=pdl,
    )
    if splits > 1:
        _decode_attention_merge_kernel[(B, Hq)](part, out, out.stride(0), out.stride(1), splits, D=D,
                                                SPLITS_PAD=_MAX_SPLITS, num_warps=1, PDL=pdl, launch_pdl=pdl)
    return out


_ATT_BLOCK_N = 64
_ATT_WARPS = 4
_ATT_STAGES = 3  # Triton's default on this path (``bench.decode_layers`` sweeps these three)
_MAX_SPLITS = 16


def _target_programs(device: torch.device) -> int:
    """Split only when (row, KV head) programs fill less than half the SMs: on
    an H200 at batch 64 (128 programs) a split measured slower (merge launch),
    while a long tail of a few requests leaves most SMs idle. CPU (the
    interpreter in tests): 8."""
    if device.type != "cuda":
        return 8
    return int(triton_layers.sm_count(device) * _SPLIT_BELOW)


# Split keys when (row, KV head) programs are fewer than this many per SM. On an H200 at batch 64
# (128 programs) splitting them in 3 measured 1.000 vs 1.025 ms a Qwen2.5-0.5B step in one run and
# 0.897 vs 0.881 ms in the next (bench.engine's micro A/B): no gain, so only near-idle GPUs split.
_SPLIT_BELOW = 0.5


_CHUNKS = 8  # pieces per row (at most): B * 8 programs keep the GPU busy at small B
_BLOCK = 2048  # logits per turn of a piece

if triton is not None:

    @triton.jit
    def _sample_update(x, r, idx, inv_t, greedy, m_raw, s_raw, m_t, s_t, best, best_i, best_x, UNIT: tl.constexpr):
        """Fold one block of logits ``x`` (fp32, -inf where masked) with random bits ``r`` into the lanes'
        state; a ``greedy`` row takes no noise (its argmax; a lane keeps its first index on a tie)."""
        m_new = tl.maximum(m_raw, x)
        s_raw = s_raw * tl.exp(m_raw - m_new) + tl.exp(x - m_new)
        m_raw = m_new
        if UNIT:
            xt = x
        else:
            xt = x * inv_t
            mt_new = tl.maximum(m_t, xt)
            s_t = s_t * tl.exp(m_t - mt_new) + tl.exp(xt - mt_new)
            m_t = mt_new
        g = tl.where(greedy, xt, xt - tl.log(-tl.log(tl.uint_to_uniform_float(r))))  # + Gumbel(0, 1)
        take = g > best
        return m_raw, s_raw, m_t, s_t, tl.where(take, g, best), tl.where(take, idx, best_i), tl.where(take, x, best_x)

    @triton.jit
    def _sample_pieces_kernel(logits_ptr, stride_b, temp_ptr, seed_ptr, part_ptr, V, CHUNK,
                              UNIT: tl.constexpr, BLOCK: tl.constexpr):
        """One (row, piece): BLOCK logits a turn as four quarter blocks that share one
        Philox call (``randint4x``: four 32-bit outputs per counter)."""
        Q: tl.constexpr = BLOCK // 4
        b = tl.program_id(0)
        c = tl.program_id(1)
        seed = tl.load(seed_ptr)
        t = tl.load(temp_ptr + b)
        greedy = t <= 0.0  # temperature 0: the argmax, its log-prob under the unmodified logits
        inv_t = 1.0 / tl.where(greedy, 1.0, t)
        lanes = tl.arange(0, Q)
        m_raw = tl.full([Q], -3.0e38, tl.float32)  # finite: a masked lane never makes nan
        s_raw = tl.zeros([Q], tl.float32)
        m_t = tl.full([Q], -3.0e38, tl.float32)
        s_t = tl.zeros([Q], tl.float32)
        best = tl.full([Q], float("-inf"), tl.float32)
        best_i = tl.zeros([Q], tl.int32)
        best_x = tl.zeros([Q], tl.float32)
        lo = c * CHUNK  # CHUNK is a multiple of BLOCK: Philox counters never repeat
        hi = tl.minimum(lo + CHUNK, V)
        row = logits_ptr + b * stride_b
        for start in range(lo, hi, BLOCK):
            i0 = start + lanes
            r0, r1, r2, r3 = tl.randint4x(seed, b * V + i0)
            x = tl.load(row + i0, mask=i0 < hi, other=float("-inf")).to(tl.float32)
            m_raw, s_raw, m_t, s_t, best, best_i, best_x = _sample_update(
                x, r0, i0, inv_t, greedy, m_raw, s_raw, m_t, s_t, best, best_i, best_x, UNIT)
            i1 = i0 + Q
            x = tl.load(row + i1, mask=i1 < hi, other=float("-inf")).to(tl.float32)
            m_raw, s_raw, m_t, s_t, best, best_i, best_x = _sample_update(
                x, r1, i1, inv_t, greedy, m_raw, s_raw, m_t, s_t, best, best_i, best_x, UNIT)
            i2 = i1 + Q
            x = tl.load(row + i2, mask=i2 < hi, other=float("-inf")).to(tl.float32)
            m_raw, s_raw, m_t, s_t, best, best_i, best_x = _sample_update(
                x, r2, i2, inv_t, greedy, m_raw, s_raw, m_t, s_t, best, best_i, best_x, UNIT)
            i3 = i2 + Q
            x = tl.load(row + i3, mask=i3 < hi, other=float("-inf")).to(tl.float32)
            m_raw, s_raw, m_t, s_t, best, best_i, best_x = _sample_update(
                x, r3, i3, inv_t, greedy, m_raw, s_raw, m_t, s_t, best, best_i, best_x, UNIT)
        if UNIT:
            m_t = m_raw
            s_t = s_raw
        mr = tl.max(m_raw, 0)
        mt = tl.max(m_t, 0)
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, best_i, V), 0)  # a tie goes to the smallest index, as torch.argmax
        pick = (best == top) & (best_i == first)  # one lane: each holds indices of its own
        out = part_ptr + (b * tl.num_programs(1) + c) * 8
        tl.store(out + 0, mr)
        tl.store(out + 1, tl.sum(s_raw * tl.exp(m_raw - mr), 0))
        tl.store(out + 2, mt)
        tl.store(out + 3, tl.sum(s_t * tl.exp(m_t - mt), 0))
        tl.store(out + 4, top)
        tl.store(out + 5, tl.sum(tl.where(pick, best_x, 0.0), 0))
        tl.store(out + 6, first.to(tl.float32))  # < 2**24: exact

    @triton.jit
    def _sample_merge_kernel(part_ptr, temp_ptr, token_ptr, lp_ptr, raw_ptr, pieces, PIECES_PAD: tl.constexpr):
        b = tl.program_id(0)
        c = tl.arange(0, PIECES_PAD)
        ok = c < pieces
        row = part_ptr + (b * pieces + c) * 8
        mr, sr = tl.load(row + 0, mask=ok, other=-3.0e38), tl.load(row + 1, mask=ok, other=0.0)
        mt, st = tl.load(row + 2, mask=ok, other=-3.0e38), tl.load(row + 3, mask=ok, other=0.0)
        best = tl.load(row + 4, mask=ok, other=float("-inf"))
        x, i = tl.load(row + 5, mask=ok, other=0.0), tl.load(row + 6, mask=ok, other=0.0)
        m = tl.max(mr, 0)
        lse_raw = m + tl.log(tl.sum(sr * tl.exp(mr - m), 0))
        m = tl.max(mt, 0)
        lse_t = m + tl.log(tl.sum(st * tl.exp(mt - m), 0))
        k = tl.argmax(best, 0, tie_break_left=True)  # pieces cover the vocabulary in order: the smallest index
        xk = tl.sum(tl.where(c == k, x, 0.0), 0)
        token = tl.sum(tl.where(c == k, i, 0.0), 0)
        t = tl.load(temp_ptr + b)
        tl.store(token_ptr + b, token.to(tl.int64))
        tl.store(raw_ptr + b, xk - lse_raw)
        tl.store(lp_ptr + b, xk / tl.where(t <= 0.0, 1.0, t) - lse_t)  # greedy: lse_t is lse_raw


def sampling_supported(logits: torch.Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.shape[-1] >= _CHUNKS and logits.shape[-1] < (1 << 24)


def sample_gumbel(logits: torch.Tensor, temperature: torch.Tensor, unit_temperature: bool,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] (bf16 / fp32, unit last stride), temperature [B] >= 0 ->
    (token [B] int64, logprob [B] under softmax(x / T), raw logprob [B] under softmax(x)).
    A row at temperature 0 is greedy: its argmax (the smallest index on a tie, as
    ``torch.argmax``), logprob = raw logprob, as the eager sampler gives it."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("sample_gumbel: logits need a unit last stride")
    seed = torch.randint(0, 2**31 - 1, (1,), device=logits.device, generator=generator, dtype=torch.int32)
    temperature = temperature.float()
    chunk = triton.cdiv(triton.cdiv(V, _CHUNKS), _BLOCK) * _BLOCK
    pieces = triton.cdiv(V, chunk)
    part = torch.empty((B, pieces, 8), device=logits.device, dtype=torch.float32)
    _sample_pieces_kernel[(B, pieces)](logits, logits.stride(0), temperature, seed, part, V, chunk,
                                       UNIT=unit_temperature, BLOCK=_BLOCK, num_warps=4)
    token = torch.empty(B, device=logits.device, dtype=torch.int64)
    lp = torch.empty(B, device=logits.device, dtype=torch.float32)
    raw = torch.empty(B, device=logits.device, dtype=torch.float32)
    _sample_merge_kernel[(B,)](part, temperature, token, lp, raw, pieces,
                               PIECES_PAD=triton.next_power_of_2(pieces), num_warps=1)
    return token, lp, raw
