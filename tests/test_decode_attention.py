"""The Triton decode-attention kernel against SDPA (CUDA only)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from actors.engines import decode_attention as da

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and da.triton is not None), reason="needs CUDA + Triton")]


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
def test_kernel_matches_sdpa_and_writes_the_step_into_the_cache(dtype, tol, heads):
    Hq, Hkv, D = heads
    B, slots, L = 5, 8, 400
    torch.manual_seed(0)
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device="cuda", dtype=dtype)
    q = qkv[:, : Hq * D].view(B, Hq, D).contiguous()
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(B, Hkv, D).contiguous()
    v = qkv[:, (Hq + Hkv) * D :].view(B, Hkv, D)  # strided, as the engine passes it
    kc = torch.randn(slots, Hkv, L, D, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    positions = torch.tensor([0, 1, 63, 64, 399], device="cuda")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = reference(q, k, v, kc_ref, vc_ref, positions, 1 / math.sqrt(D))
    got = da.decode_attention(q, k, v, kc, vc, positions, 1 / math.sqrt(D))
    assert (got.float() - want).abs().max().item() < tol
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
