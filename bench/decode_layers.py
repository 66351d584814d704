"""Decode-step matmuls at small batch (CUDA): cuBLAS plus the kernels a layer runs
around it, against the Triton kernels of ``actors.engines.triton_layers``, per tiling.

    python -m bench.decode_layers [--rows 64] [--out PATH]

Shapes are a Qwen2.5-0.5B layer (hidden 896, MLP 4864, 14 query / 2 KV heads of 64).
Each op runs once per layer on 24 distinct weight copies (as a step reads them:
no weight stays in L2), captured in a CUDA graph; times are per op, averaged over
replays. The four ops, torch path vs Triton path:

    qkv       F.linear(x, Wqkv, b)                        linear
    o_norm    h + F.linear(a, Wo); rms_norm               linear_partials + add_rms_norm
    gate_up   silu(g) * u of F.linear(x, Wgu)             gate_up_silu
    down_norm h + F.linear(act, Wd); rms_norm             linear_partials + add_rms_norm

Then the decode attention kernel per (BLOCK_N, warps, stages). Every variant in a
sweep is checked against the default (``rel_err``).
Prints one JSON object: per rows and op, the torch time, the default tiling's time,
and the best tiling with its time.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from actors.engines import triton_kernels as TK
from actors.engines import triton_layers as TL
from bench import emit

H, I, HQ, HKV, D, LAYERS = 896, 4864, 14, 2, 64, 24
EPS = 1e-6


def timed_graph(fn, reps: int = 20) -> float:
    """Microseconds per call of ``fn(layer)`` over LAYERS layers, replayed in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for n in range(LAYERS):
            fn(n)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for n in range(LAYERS):
            fn(n)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * LAYERS)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def ops(m: int, dev: str):
    """name -> (torch fn(layer), triton fn(layer, tiling, fresh), n, k, gated, split) at ``m`` rows."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(torch.bfloat16)

    x = rand(m, H, scale=1.0)
    a = rand(m, HQ * D, scale=1.0)
    act = rand(m, I, scale=1.0)
    h = rand(m, H, scale=1.0)
    norm_w = rand(H, scale=1.0)
    w_qkv = [rand((HQ + 2 * HKV) * D, H) for _ in range(LAYERS)]
    b_qkv = [rand((HQ + 2 * HKV) * D) for _ in range(LAYERS)]
    w_o = [rand(H, HQ * D) for _ in range(LAYERS)]
    w_gu = [rand(2 * I, H) for _ in range(LAYERS)]
    w_d = [rand(H, I) for _ in range(LAYERS)]

    def torch_o(n):
        y = h + F.linear(a, w_o[n])
        return F.rms_norm(y, (H,), norm_w, EPS)

    def torch_gu(n):
        gate, up = F.linear(x, w_gu[n]).chunk(2, dim=-1)
        return F.silu(gate) * up

    def torch_down(n):
        y = h + F.linear(act, w_d[n])
        return F.rms_norm(y, (H,), norm_w, EPS)

    hs = h.clone()  # the Triton path adds into its residual in place (``fresh`` resets it for a check)

    def tri_o(n, t, fresh=False):
        if fresh:
            hs.copy_(h)
        return TL.add_rms_norm(TL.linear_partials(a, w_o[n], t), hs, norm_w, EPS)

    def tri_down(n, t, fresh=False):
        if fresh:
            hs.copy_(h)
        return TL.add_rms_norm(TL.linear_partials(act, w_d[n], t), hs, norm_w, EPS)

    return {
        "qkv": (lambda n: F.linear(x, w_qkv[n], b_qkv[n]), lambda n, t, fresh=False: TL.linear(x, w_qkv[n], b_qkv[n], t),
                (HQ + 2 * HKV) * D, H, False, False),
        "o_norm": (torch_o, tri_o, H, HQ * D, False, True),
        "gate_up": (torch_gu, lambda n, t, fresh=False: TL.gate_up_silu(x, w_gu[n], t), I, H, True, False),
        "down_norm": (torch_down, tri_down, H, I, False, True),
    }


def candidates(k: int, split: bool, gated: bool) -> list[TL.Tiling]:
    out = []
    for bn, bk, stages in itertools.product((16, 32, 64), (64, 128, 256), (4,)):
        if gated and bn == 64 and bk == 256:
            continue  # two 64x256 weight tiles a stage: past shared memory
        for pieces in ((1, 2, 4, 8) if split else (1,)):
            if k // bk >= 2 * pieces or pieces == 1:
                out.append(TL.Tiling(bn, bk, pieces, 4, stages))
    return out


def attention_sweep(m: int, dev: str) -> dict:
    """The decode attention kernel (cache write + RoPE + attention) at ``m`` rows, contexts
    128..383 (a 128-token prompt with up to 256 generated), per (BLOCK_N, warps, stages)."""
    g = torch.Generator(device=dev).manual_seed(1)
    L = 384
    q = torch.randn(m, HQ, D, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(m, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(m, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    caches = [(torch.randn(m, HKV, L, D, device=dev, generator=g).to(torch.bfloat16),
               torch.randn(m, HKV, L, D, device=dev, generator=g).to(torch.bfloat16)) for _ in range(LAYERS)]
    positions = torch.randint(128, L, (m,), device=dev, generator=g)
    angle = torch.arange(L, device=dev)[:, None] * torch.rand(D // 2, device=dev, generator=g).repeat(2)[None, :]
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)

    def run(n):
        return TK.decode_attention(q, k, v, caches[n][0], caches[n][1], positions, D**-0.5, cos, sin)

    default = (TK._ATT_BLOCK_N, TK._ATT_WARPS, TK._ATT_STAGES)
    want = run(0)
    entry = {"default": default, "default_us": round(timed_graph(run), 2), "sweep": []}
    for cfg in itertools.product((32, 64, 128), (2, 4), (2, 3)):
        TK._ATT_BLOCK_N, TK._ATT_WARPS, TK._ATT_STAGES = cfg
        try:
            err = rel_err(run(0), want)
            entry["sweep"].append({"cfg": cfg, "us": round(timed_graph(run), 2), "rel_err": round(err, 5)})
        except Exception as e:
            entry["sweep"].append({"cfg": cfg, "error": type(e).__name__})
    TK._ATT_BLOCK_N, TK._ATT_WARPS, TK._ATT_STAGES = default
    ok = sorted((s for s in entry["sweep"] if "us" in s and s["rel_err"] < 1e-2), key=lambda s: s["us"])
    entry["best"] = ok[0] if ok else None
    entry["sweep"] = ok[:8]
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = "cuda"
    result = {"bench": "decode_layers", "machine": torch.cuda.get_device_name(), "torch": torch.__version__,
              "layers": LAYERS, "shape": {"hidden": H, "mlp": I, "q_heads": HQ, "kv_heads": HKV, "head_dim": D},
              "unit": "us per op (per layer)", "rows": {}}
    for m in args.rows:
        rows = result["rows"][str(m)] = {}
        for name, (torch_fn, tri_fn, n, k, gated, split) in ops(m, dev).items():
            want = torch_fn(0)
            entry = {"torch_us": round(timed_graph(torch_fn), 2)}
            default = TL.default_tiling(n, k, torch.device(dev), gated=gated, split=split)
            entry["default"] = repr(default)
            entry["default_us"] = round(timed_graph(lambda i: tri_fn(i, default)), 2)
            entry["default_rel_err"] = round(rel_err(tri_fn(0, default, True), want), 5)
            sweep = []
            for t in candidates(k, split, gated):
                try:
                    err = rel_err(tri_fn(0, t, True), want)
                    us = timed_graph(lambda i: tri_fn(i, t))
                except Exception as e:  # a tiling past the GPU's limits (shared memory)
                    sweep.append({"tiling": repr(t), "error": type(e).__name__})
                    continue
                sweep.append({"tiling": repr(t), "us": round(us, 2), "rel_err": round(err, 5)})
            ok = [s for s in sweep if "us" in s and s["rel_err"] < 2e-2]
            best = min(ok, key=lambda s: s["us"]) if ok else None
            entry["best"] = best
            entry["max_rel_err_in_sweep"] = max((s["rel_err"] for s in sweep if "rel_err" in s), default=None)
            entry["sweep"] = sorted((s for s in sweep if "us" in s), key=lambda s: s["us"])[:8]
            rows[name] = entry
            print(f"rows {m} {name}: torch {entry['torch_us']} us, default {entry['default_us']} us "
                  f"({default}), best {best and best['us']} us ({best and best['tiling']})", flush=True)
        att = rows["attention"] = attention_sweep(m, dev)
        print(f"rows {m} attention: default {att['default_us']} us {att['default']}, best {att['best']}", flush=True)
    emit(result, args.out, indent=1)


if __name__ == "__main__":
    main()
