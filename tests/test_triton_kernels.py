"""The Triton decode-attention kernel against SDPA (CUDA only)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from actors.engines import triton_kernels as tk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and tk.triton is not None), reason="needs CUDA + Triton")]


def rope(x, cos, sin):  # x [B, H, D], cos / sin [B, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos[:, None].float() + rotated.float() * sin[:, None].float()).to(x.dtype)


def reference(q, k, v, k_cache, v_cache, positions, scale):
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    rows = torch.arange(B, device=q.device)
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = v
    L = k_cache.shape[2]
    mask = (torch.arange(L, device=q.device)[None, :] <= positions[:, None]).view(B, 1, 1, L)
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D).float(), k_cache[:B].float(),
                                         v_cache[:B].float(), attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, D)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [(14, 2, 64), (4, 4, 16), (16, 8, 128)])
@pytest.mark.parametrize("with_rope", [False, True])
@pytest.mark.parametrize("B", [5, 300])  # 5 rows: keys cut into splits (flash-decoding) and merged; 300: one pass
def test_kernel_matches_sdpa_and_writes_the_step_into_the_cache(dtype, tol, heads, with_rope, B):
    Hq, Hkv, D = heads
    slots, L = B + 3, 400
    torch.manual_seed(0)
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device="cuda", dtype=dtype)
    q = qkv[:, : Hq * D].view(B, Hq, D).contiguous()
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(B, Hkv, D).contiguous()
    v = qkv[:, (Hq + Hkv) * D :].view(B, Hkv, D)  # strided, as the engine passes it
    kc = torch.randn(slots, Hkv, L, D, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    positions = torch.tensor([0, 1, 63, 64, 399] + torch.randint(0, L, (B - 5,)).tolist(), device="cuda")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    cos = sin = None
    if with_rope:
        angle = torch.arange(L, device="cuda")[:, None] * torch.rand(D // 2, device="cuda").repeat(2)[None, :]
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        want = reference(rope(q, cos[positions], sin[positions]), rope(k, cos[positions], sin[positions]), v,
                         kc_ref, vc_ref, positions, 1 / math.sqrt(D))
    else:
        want = reference(q, k, v, kc_ref, vc_ref, positions, 1 / math.sqrt(D))
    got = tk.decode_attention(q, k, v, kc, vc, positions, 1 / math.sqrt(D), cos, sin)
    assert (got.float() - want).abs().max().item() < tol
    assert torch.equal(vc, vc_ref)
    if with_rope:  # rotated in fp32 inside the kernel (fused multiply-adds): last-bit differences
        assert (kc.float() - kc_ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 5e-2)
    else:
        assert torch.equal(kc, kc_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_kernel_draws_from_softmax_and_reports_its_logprobs(dtype, temperature):
    """Frequencies over 20k rows of the same logits match softmax(x / T) within
    5 standard errors; log-probs equal log_softmax at the drawn token."""
    B, V = 20_000, 50
    torch.manual_seed(0)
    base = (torch.randn(V, device="cuda") * 2).to(dtype)
    logits = base.repeat(B, 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    temp = torch.full((B,), temperature, device="cuda")
    token, lp, raw = tk.sample_gumbel(logits, temp, temperature == 1.0, g)
    x = base.float()
    p = torch.softmax(x / temperature, -1)
    freq = torch.bincount(token, minlength=V).float() / B
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / B).sqrt() + 1e-4).all()
    assert (lp - torch.log_softmax(x / temperature, -1)[token]).abs().max().item() < 1e-5
    assert (raw - torch.log_softmax(x, -1)[token]).abs().max().item() < 1e-5
    again, _, _ = tk.sample_gumbel(logits, temp, temperature == 1.0, g)
    assert not torch.equal(token, again)  # a fresh draw each call


def test_sampling_kernel_over_a_real_vocabulary_matches_the_eager_sampler_in_distribution():
    """V = 151,936 (pieces and blocks with a ragged tail): the token's logprob is
    consistent and tokens land where the probability mass is."""
    from actors.engines.sampling import SamplingBatch, sample

    B, V = 64, 151_936
    torch.manual_seed(1)
    logits = (torch.randn(B, V, device="cuda") * 3).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    ones = torch.ones(B, device="cuda")
    params = SamplingBatch(temperature=ones, top_k=ones.long() * 0, top_p=ones, seed=ones.long(), needs_filter=False,
                           any_greedy=False, unit_temperature=True, generator=g)
    token, lp, raw = sample(logits, params, torch.zeros(B, dtype=torch.long, device="cuda"))
    want = torch.log_softmax(logits.float(), -1).gather(-1, token[:, None]).squeeze(-1)
    assert (raw - want).abs().max().item() < 1e-4 and torch.equal(lp, raw)
    assert want.mean().item() > torch.log_softmax(logits.float(), -1).mean().item() + 3  # not uniform picks


def test_sampling_kernel_takes_greedy_rows_beside_sampled_ones():
    from tests.test_engine_sampling import check_kernel_greedy_rows

    check_kernel_greedy_rows("cuda")


def test_a_batch_with_greedy_rows_samples_in_the_kernel_as_the_eager_sampler_would():
    """An evaluation's greedy rows beside training's sampled ones no longer send the whole
    batch to the eager path: the same tokens and log-probs for the greedy rows."""
    from actors.engines.sampling import SamplingBatch, sample

    B, V = 64, 49_152
    torch.manual_seed(2)
    logits = (torch.randn(B, V, device="cuda") * 3).to(torch.bfloat16)
    temp = torch.tensor([0.0, 1.0] * (B // 2), device="cuda")
    ones = torch.ones(B, device="cuda")
    params = SamplingBatch(temperature=temp, top_k=ones.long() * 0, top_p=ones, seed=ones.long(), needs_filter=False,
                           any_greedy=True, unit_temperature=False,
                           generator=torch.Generator(device="cuda").manual_seed(0))
    calls = []
    kernel = tk.sample_gumbel
    try:
        tk.sample_gumbel = lambda *a: calls.append(1) or kernel(*a)
        token, lp, raw = sample(logits, params, torch.zeros(B, dtype=torch.long, device="cuda"))
    finally:
        tk.sample_gumbel = kernel
    assert calls == [1]
    greedy = temp <= 0
    want = torch.log_softmax(logits.float(), -1)
    assert torch.equal(token[greedy], logits.float()[greedy].argmax(-1))
    assert (raw - want.gather(-1, token[:, None]).squeeze(-1)).abs().max().item() < 1e-4
    assert torch.equal(lp[greedy], raw[greedy])
