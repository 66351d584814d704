"""The Triton matmul / norm kernels of small-batch decode steps against torch (CUDA only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.engines import triton_layers as TL
from actors.engines.kv_cache import KVCache
from actors.engines.model import Model, ModelConfig
from actors.engines.weights import WeightStore

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and TL.triton is not None), reason="needs CUDA + Triton")]

DT = torch.bfloat16
TILINGS = [None, TL.Tiling(16, 64, 3), TL.Tiling(32, 128, 2, num_stages=3)]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("m", [5, 64])
@pytest.mark.parametrize("n,k", [(1152, 896), (40, 200)])
@pytest.mark.parametrize("tiling", TILINGS)
def test_matmuls_match_torch_in_bf16(m, n, k, tiling):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=DT)
    w = torch.randn(2 * n, k, device="cuda", dtype=DT) * 0.05
    b = torch.randn(n, device="cuda", dtype=DT)
    assert rel(TL.linear(x, w[:n], b, tiling), F.linear(x, w[:n], b)) < 1e-2
    assert rel(TL.linear(x, w[:n], None, tiling), F.linear(x, w[:n])) < 1e-2
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    assert rel(TL.gate_up_silu(x, w, tiling), F.silu(gate) * up) < 2e-2
    parts = TL.linear_partials(x, w[:n], tiling)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (m, n)
    assert rel(parts.sum(0), F.linear(x.float(), w[:n].float())) < 1e-4  # fp32 sums of bf16 products


@pytest.mark.parametrize("m,n,pieces", [(1, 896, 1), (7, 896, 4), (64, 96, 3)])
def test_add_rms_norm_adds_the_partials_in_place_and_normalizes(m, n, pieces):
    torch.manual_seed(1)
    parts = torch.randn(pieces, m, n, device="cuda")
    h = torch.randn(m, n, device="cuda", dtype=DT)
    w = torch.randn(n, device="cuda", dtype=DT)
    want_h = h + parts.sum(0).to(DT)
    want_x = F.rms_norm(want_h.float(), (n,), w.float(), 1e-6)
    x = TL.add_rms_norm(parts, h, w, 1e-6)
    assert torch.equal(h, want_h)
    assert rel(x, want_x) < 1e-2
    only = TL.add_rms_norm(None, want_h.clone(), w, 1e-6)
    assert rel(only, want_x) < 1e-2


def test_more_rows_than_a_tile_is_a_clear_error():
    x = torch.randn(65, 64, device="cuda", dtype=DT)
    with pytest.raises(ValueError, match="65 rows"):
        TL.linear(x, torch.randn(32, 64, device="cuda", dtype=DT))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float32, 1e-5)])
def test_decode_step_with_triton_layers_matches_the_torch_path(tiny_models, family, dtype, tol):
    """(fp32 also runs this path in the engine's CUDA contract tests, against HF.)"""
    path, _ = tiny_models[family]
    dev = torch.device("cuda")
    cfg = ModelConfig.from_dir(path)
    weights = WeightStore(cfg, dev, dtype)
    weights.load_dir(path)
    model = Model(cfg, 64, dev, dtype)
    assert model.triton_layers
    B, T = 6, 9
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, cfg.vocab_size, (B, T), generator=g).to(dev)
    step = torch.randint(1, cfg.vocab_size, (B,), generator=g).to(dev)
    positions = torch.full((B,), T, device=dev)
    out = {}
    for triton_layers in (False, True):
        kv = KVCache(cfg.num_layers, B, cfg.num_kv_heads, 64, cfg.head_dim, dev, dtype)
        model.triton_layers = triton_layers
        model.prefill(weights, kv, tokens, torch.arange(B, device=dev), torch.full((B,), T - 1, device=dev))
        out[triton_layers] = (model.decode(weights, kv, step, positions).float(), kv.k[0][:B, :, T].clone())
    assert rel(out[True][0], out[False][0]) < tol
    assert (out[True][0].argmax(-1) == out[False][0].argmax(-1)).float().mean() >= 5 / 6
    assert rel(out[True][1], out[False][1]) < tol  # this step's key went into the cache


def test_programmatic_dependent_launch_changes_no_result_in_a_graph(tiny_models):
    """The decode step replayed as a CUDA graph with and without PDL: bit-identical logits and cache."""
    from actors.engines.cuda_graphs import DecodeGraphs

    path, _ = tiny_models["qwen2"]
    dev = torch.device("cuda")
    cfg = ModelConfig.from_dir(path)
    weights = WeightStore(cfg, dev, DT)
    weights.load_dir(path)
    model = Model(cfg, 64, dev, DT)
    B = 8
    tokens = torch.randint(1, cfg.vocab_size, (B,), device=dev)
    out = []
    try:
        for flag in (False, None):
            TL.PDL = flag
            kv = KVCache(cfg.num_layers, B, cfg.num_kv_heads, 64, cfg.head_dim, dev, DT)
            graphs = DecodeGraphs(model, B, dev)
            for pos in range(5):  # five steps, each reading the keys the previous ones wrote
                logits = graphs.decode(weights, kv, tokens, torch.full((B,), pos, device=dev)).clone()
            out.append((logits, kv.k[1].clone()))
    finally:
        TL.PDL = None
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_qwen3_keeps_the_torch_path(tiny_models):
    path, _ = tiny_models["qwen3"]
    assert not Model(ModelConfig.from_dir(path), 64, torch.device("cuda"), DT).triton_layers
