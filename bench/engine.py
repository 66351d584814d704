"""Rollout throughput: the built-in TorchEngine against Hugging Face
``generate`` on the same random-weight model, batch and lengths, in one run.

    python -m bench.engine                                   # CPU, small model, batch 16
    python -m bench.engine --device cuda --batch 64 256 --check   # H200, Qwen2.5-0.5B shape
    python -m bench.engine --shape tiny --batch 64 256 --new-tokens 128 --threads 1 --skip-hf   # host overhead
    python -m bench.engine --shape tiny --batch 64 256 --varied-lengths --overlap on --skip-hf  # the chain on CPU

Prints one JSON object (and writes it to ``--out`` when given). Every
request is a fixed-length rollout: random prompt of ``--prompt-len`` tokens,
exactly ``--new-tokens`` new tokens (no stop token), sampled at T=1
(``--varied-lengths``: request i stops after a length drawn in
[new_tokens / 8, new_tokens], so requests end on different steps and the
running set changes often, as in RL; ``engine_num_chain_breaks`` then counts
the overlapped steps read back before the next could launch from their tokens
on the device). ``--overlap on`` runs the overlapped path on CPU too (a smoke
test of its logic and host cost; there the device never runs ahead). Tokens/s counts new tokens over wall
time from submitting the batch to the last token, prefill included. HF is
timed both sampling (T=1) and greedy; ``ratio`` is against the faster of the
two (the engine always samples). ``--check`` first verifies the engine
against HF on the device (greedy tokens, log-probs, sleep freeing memory).

``engine_turn_us`` splits the engine thread's turns (admission, prefill,
decode, posting; idle waits for work are not in them) per turn: ``host`` is
everything but the model's forward calls, the sampler and the waits for the
device, i.e. the Python bookkeeping between launches; ``forward`` and
``sample`` are compute on CPU and launch time on CUDA; ``device_wait`` is
the host blocked on the device. On CPU with the ``tiny`` shape the forward is
small, so ``host`` shows the per-turn Python cost (a smoke test of it, not a
GPU figure).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time

import torch
import transformers

import loop
from actors.engines import GenerateRequest, SamplingParams, triton_kernels, triton_layers
from actors.engines.torch_engine import TorchEngine
from bench import emit
from bench.pipeline_report import offcpu_share, turn_us

SHAPES = {
    # the per-turn host cost made visible on a CPU: the forward is a small part of a turn
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    # a small model that still has real matmuls on a laptop CPU
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
}


def build_model(shape: str, path: str, device: str, dtype: torch.dtype, seed: int = 0):
    cfg = transformers.Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                                   rope_theta=1e6, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(path)
    return model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_hf(model, prompts: torch.Tensor, new_tokens: int, device: str, do_sample: bool) -> float:
    """Tokens/s of ``generate`` (sampling at T=1 or greedy, fixed length)."""
    kwargs = dict(do_sample=do_sample, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  pad_token_id=0, eos_token_id=None)
    if do_sample:
        kwargs.update(temperature=1.0, top_k=0, top_p=1.0)
    with torch.no_grad():
        model.generate(prompts[:, :8], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(prompts, **kwargs)
        _sync(device)
        elapsed = time.perf_counter() - t0
    assert out.shape[1] == prompts.shape[1] + new_tokens
    return prompts.shape[0] * new_tokens / elapsed


def request_lengths(batch: int, new_tokens: int, varied: bool) -> list[int]:
    """New tokens per request: all ``new_tokens``, or (varied) drawn in [new_tokens / 8, new_tokens]."""
    if not varied:
        return [new_tokens] * batch
    g = torch.Generator().manual_seed(batch)
    return torch.randint(max(1, new_tokens // 8), new_tokens + 1, (batch,), generator=g).tolist()


async def _run_batch(engine: TorchEngine, prompts: list[list[int]], lengths: list[int], tag: str) -> float:
    sampling = SamplingParams(temperature=1.0)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(GenerateRequest(
        request_id=f"{tag}-{i}", prompt_ids=p, max_tokens=n, sampling=sampling))
        for i, (p, n) in enumerate(zip(prompts, lengths))))
    elapsed = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == lengths
    return sum(lengths) / elapsed


async def bench_engine(path: str, prompts: list[list[int]], new_tokens: int, device: str, dtype: str,
                       cuda_graphs: bool, overlap_steps: bool | None = None, micro: bool = True,
                       compile_decode: bool | str = True, varied: bool = False) -> dict:
    engine = TorchEngine(path, device=device, dtype=dtype, max_num_seqs=len(prompts),
                         max_model_len=len(prompts[0]) + new_tokens, cuda_graphs=cuda_graphs,
                         overlap_steps=overlap_steps, compile_decode=compile_decode)
    await engine.setup()
    try:
        # warm-up on the timed run's lengths: every step and batch size it will see runs once untimed
        await _run_batch(engine, prompts, request_lengths(len(prompts), new_tokens, varied), "warm")
        timing = engine._core.timing
        for k in timing:
            timing[k] = type(timing[k])(0)
        cpu0 = engine._core.thread_cpu_s()
        tps = await _run_batch(engine, prompts, request_lengths(len(prompts), new_tokens, varied), "timed")
        stats = engine.statistics()
        offcpu = offcpu_share(stats["turn_s"], stats["thread_cpu_s"] - cpu0) if cpu0 is not None else None
        micro = microbench(engine._core, len(prompts)) if micro and device.startswith("cuda") else None
    finally:
        await engine.close()
    return {"tokens_per_s": tps, "kv_cache_bytes": stats["kv_cache_bytes"], "micro": micro,
            "graph_capture_s": round(stats.get("graph_capture_s", 0.0), 3),
            "turn_us": turn_us(stats), "offcpu_share": offcpu,
            "timing": {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()
                       if k.startswith(("decode", "prefill", "num_decode", "num_turns", "num_chain"))}}


def microbench(core, batch: int, iters: int = 30) -> dict:
    """Per-step GPU time of the parts of a decode step (engine idle: it writes
    junk KV into free slots), plus the top kernels of one eager step."""
    from actors.engines.sampling import SamplingBatch, sample

    dev = core.opts.device
    tokens = torch.randint(0, core.cfg.vocab_size, (batch,), device=dev)
    positions = torch.full((batch,), 200, device=dev)
    ones = torch.ones(batch, device=dev)
    params = SamplingBatch(temperature=ones, top_k=ones.long() * 0, top_p=ones, seed=ones.long(),
                           needs_filter=False, any_greedy=False, unit_temperature=True,
                           generator=torch.Generator(device=dev).manual_seed(0))

    def timeit(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return round(start.elapsed_time(end) / iters, 4)

    out = {"batch": batch, "triton_layers": core.model.triton_layers and batch <= triton_layers.MAX_ROWS}
    if core.graphs is not None:
        out["forward_graph_ms"] = timeit(lambda: core.graphs.decode(core.weights, core.kv, tokens, positions))

        def variant(key: str, owner, name: str, value) -> None:
            """The graph step with ``owner.name = value``, re-captured; then restored."""
            kept = getattr(owner, name)
            setattr(owner, name, value)
            core.graphs.reset()
            out[key] = timeit(lambda: core.graphs.decode(core.weights, core.kv, tokens, positions))
            setattr(owner, name, kept)
            core.graphs.reset()

        if out["triton_layers"]:
            if triton_layers.pdl(dev):
                variant("forward_graph_no_pdl_ms", triton_layers, "PDL", False)
            # decode attention splitting keys below two programs per SM (3 splits at batch 64)
            variant("forward_graph_attention_split_below_2_per_sm_ms", triton_kernels, "_SPLIT_BELOW", 2.0)
            # cuBLAS matmuls and compiled elementwise halves
            variant("forward_graph_torch_layers_ms", core.model, "triton_layers", False)
    out["forward_eager_ms"] = timeit(lambda: core.model.decode(core.weights, core.kv, tokens, positions))
    if core.model.fused_attention:  # the same eager step with cache writes + SDPA instead of the kernel
        core.model.fused_attention = False
        out["forward_eager_sdpa_ms"] = timeit(lambda: core.model.decode(core.weights, core.kv, tokens, positions))
        core.model.fused_attention = True
    logits = core.model.decode(core.weights, core.kv, tokens, positions)
    out["sample_ms"] = timeit(lambda: sample(logits, params, positions + 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            sample(core.model.decode(core.weights, core.kv, tokens, positions), params, positions + 1)
        torch.cuda.synchronize()
    print(f"--- top kernels, batch {batch}, 3 eager steps ---", file=sys.stderr)  # stdout: the JSON alone
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70),
          file=sys.stderr)
    return out


async def check_on_device(device: str, root: str) -> dict:
    """Engine vs HF on ``device``: fp32 tiny model (greedy tokens, log-probs)
    and what sleep frees on CUDA."""
    path = os.path.join(root, "check")
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, tie_word_embeddings=True)
    torch.manual_seed(1)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    hf.save_pretrained(path)
    hf = hf.to(device)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 40)), [42]]
    engine = TorchEngine(path, device=device, dtype="float32", max_num_seqs=4, max_model_len=96)
    await engine.setup()
    result: dict = {}
    try:
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(
            request_id=str(i), prompt_ids=p, max_tokens=40, sampling=SamplingParams(temperature=0.0)))
            for i, p in enumerate(prompts)))
        match, max_err = True, 0.0
        for p, o in zip(prompts, outs):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p], device=device), max_new_tokens=40, min_new_tokens=40,
                                  do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                lp = hf(torch.tensor([p + o.token_ids], device=device)).logits[0].float().log_softmax(-1)
            want = lp[len(p) - 1 : len(p) - 1 + len(o.token_ids)].gather(-1, torch.tensor(o.token_ids, device=device)[:, None])
            max_err = max(max_err, (want.squeeze(-1).cpu() - torch.tensor(o.raw_logprobs)).abs().max().item())
            match &= ref == o.token_ids
        result.update(greedy_matches_hf=match, max_logprob_abs_err=max_err)
        if device.startswith("cuda"):
            core = engine._core
            base = torch.cuda.memory_allocated()
            await engine.sleep(1)
            after1 = torch.cuda.memory_allocated()
            await engine.wake_up()
            await engine.sleep(2)
            after2 = torch.cuda.memory_allocated()
            await engine.wake_up()
            again = await engine.generate(GenerateRequest(request_id="again", prompt_ids=prompts[0], max_tokens=40,
                                                          sampling=SamplingParams(temperature=0.0)))
            result.update(sleep1_freed_bytes=base - after1, kv_cache_bytes=core.kv.nbytes,
                          sleep2_freed_bytes=base - after2, weights_bytes=core.weights.nbytes,
                          same_after_wake=again.token_ids == outs[0].token_ids)
    finally:
        await engine.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: small on CPU, qwen2.5-0.5b on CUDA")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default: 16 on CPU, 64 256 on CUDA")
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 64 on CPU, 128 on CUDA")
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 64 on CPU, 256 on CUDA")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--varied-lengths", action="store_true",
                    help="request lengths drawn in [new_tokens / 8, new_tokens]: the running set changes often")
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="overlapped decode steps: auto = on for CUDA only")
    ap.add_argument("--skip-hf", action="store_true", help="time the engine only")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode of the engine's decode step, e.g. max-autotune-no-cudagraphs")
    ap.add_argument("--check", action="store_true", help="verify against HF on the device first")
    ap.add_argument("--machine", default=None, help="free text saved with the result")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for both engine and HF (CPU: 1 is far steadier on a shared box)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    shape = args.shape or ("qwen2.5-0.5b" if cuda else "small")
    batches = args.batch or ([64, 256] if cuda else [16])
    prompt_len = args.prompt_len or (128 if cuda else 64)
    new_tokens = args.new_tokens or (256 if cuda else 64)
    dtype = "bfloat16" if cuda else "float32"
    torch_dtype = torch.bfloat16 if cuda else torch.float32
    overlap = {"auto": None, "on": True, "off": False}[args.overlap]

    machine = args.machine or (torch.cuda.get_device_name() if cuda else f"{platform.processor() or platform.machine()}, "
                               f"{os.cpu_count()} cores, torch {torch.get_num_threads()} threads")
    result: dict = {"bench": "engine", "machine": machine, "device": args.device, "dtype": dtype, "model_shape": shape,
                    **{k: v for k, v in SHAPES[shape].items()}, "prompt_len": prompt_len, "new_tokens": new_tokens,
                    "sampling": "T=1, " + ("varied lengths" if args.varied_lengths else "fixed length"),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "cuda_graphs": cuda and not args.no_cuda_graphs, "overlap": args.overlap, "compile_mode": args.compile_mode, "runs": []}
    with tempfile.TemporaryDirectory() as root:
        if args.check:
            result["check"] = loop.run(check_on_device(args.device, root))
        path = os.path.join(root, shape)
        hf = build_model(shape, path, args.device, torch_dtype)
        for batch in batches:
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(1, SHAPES[shape]["vocab_size"], (batch, prompt_len), generator=g)
            eng = loop.run(bench_engine(path, prompts.tolist(), new_tokens, args.device, dtype, not args.no_cuda_graphs,
                                        overlap_steps=overlap, compile_decode=args.compile_mode or True, varied=args.varied_lengths))
            # ablation: the same engine reading each step's tokens back before launching the next
            serial = loop.run(bench_engine(path, prompts.tolist(), new_tokens, args.device, dtype,
                                           not args.no_cuda_graphs, overlap_steps=False, micro=False,
                                           compile_decode=args.compile_mode or True,
                                           varied=args.varied_lengths)) if cuda else None
            run = {"batch": batch, "engine_tokens_per_s": round(eng["tokens_per_s"], 1),
                   "engine_turn_us": eng["turn_us"], "engine_graph_capture_s": eng["graph_capture_s"],
                   **({"engine_num_chain_breaks": eng["timing"].get("num_chain_breaks")} if args.varied_lengths else {}),
                   "engine_no_overlap_tokens_per_s": serial and round(serial["tokens_per_s"], 1),
                   "engine_no_overlap_turn_us": serial and serial["turn_us"]}
            if not args.skip_hf:  # HF runs fixed lengths only
                hf_sample = bench_hf(hf, prompts.to(args.device), new_tokens, args.device, do_sample=True)
                hf_greedy = bench_hf(hf, prompts.to(args.device), new_tokens, args.device, do_sample=False)
                hf_best = max(hf_sample, hf_greedy)
                run.update({"hf_generate_tokens_per_s": round(hf_best, 1),
                            "ratio": None if args.varied_lengths else round(eng["tokens_per_s"] / hf_best, 2),
                            "hf_generate_sample_tokens_per_s": round(hf_sample, 1),
                            "hf_generate_greedy_tokens_per_s": round(hf_greedy, 1)})
            result["runs"].append({**run, "kv_cache_bytes": eng["kv_cache_bytes"],
                                   "engine_timing_s": eng["timing"], "engine_micro_ms": eng["micro"]})
            if cuda:
                torch.cuda.empty_cache()
    emit(result, args.out, indent=2)


if __name__ == "__main__":
    main()
