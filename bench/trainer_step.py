"""Trainer-step benchmark: the torch and Megatron backends side by side on one model.

    python -m bench.trainer_step --device cuda --backends torch,torch_padded,megatron   # on a GPU
    python -m bench.trainer_step --device cuda --shape smollm2-135m --prompt-len 100 --response-len 100
    python -m bench.trainer_step --small                                   # CPU smoke test

Backends: ``torch`` (packed sequences and the chunked LM head, ``trainer.packed``),
``torch_padded`` (the same backend with ``packed: false``: right-padded rows, full
logits), ``torch_compiled`` (``torch`` with ``trainer.compile``: each decoder layer
``torch.compile``-d), ``torch_liger`` (``torch`` with ``trainer.kernels: liger``: Liger-Kernel's
fused RMSNorm / SwiGLU / RoPE; CUDA and the ``liger`` extra) and ``megatron``. Builds the model once (``--shape``: ``qwen2.5-0.5b``,
``bench.make_model``'s Qwen2.5-0.5B body over the built-in vocabulary, 358M
parameters; ``smollm2-135m``, SmolLM2-135M's Llama shape with its 49152-token
vocabulary and tied head, 135M; bf16, random weights; ``--small``: the tiny
shape, fp32), then sets up every backend in this one process and times
``train_step`` (one GRPO/PPO step: forward, backward, clip, AdamW) on the same
synthetic batches:
``--groups`` groups of ``--n`` samples, prompts and responses drawn around
``--prompt-len`` / ``--response-len`` tokens. Each repeat times ``--steps``
steps of every backend in turn (after ``--warmup`` untimed steps of each), so
the machine's noise falls on all of them. Prints one JSON object: per backend,
the step time of each repeat (ms), trained response tokens/s and all tokens/s,
model TFLOP/s and MFU (``actors.backends.flops``: padding is not useful work, so it
lowers MFU), peak device memory (``torch.cuda.max_memory_allocated`` while that
backend stepped, and the same over what was allocated before its steps: the
step's own activations, logits and gradients), each backend's step time over
the first one's, and ``speedup_vs_padded`` (torch_padded's step time over
torch's). A compiled backend compiles in its warm-up steps, outside the timed
window: its row adds ``compile_s`` (the warm-up calls that compiled),
``compiled_graphs`` and ``graphs_compiled_while_timed`` (0 unless a new batch
length recompiled), and ``speedup_compiled`` is torch's step time over
torch_compiled's (``speedup_liger`` likewise for torch_liger). ``torch_graphs`` and
``torch_liger_graphs`` add ``trainer.cuda_graphs`` (CUDA): they warm up on every timed batch,
so each padded shape's graphs are captured before the window (``graph_capture_s``,
``cuda_graphs``, ``graphs_captured_while_timed``), and their MFU counts real tokens only. ``--profile`` adds the busiest device kernels of one step, and on CUDA
how many kernels and host-device syncs it ran and their summed device time.

    python -m bench.trainer_step --device cuda --shape smollm2-135m --backends torch,torch_compiled --profile
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _batch(rng: random.Random, vocab: int, args: argparse.Namespace) -> list[Any]:
    from contracts.sample import Sample

    out = []
    for g in range(args.groups):
        prompt = [rng.randrange(3, vocab) for _ in range(max(1, int(args.prompt_len * rng.uniform(0.5, 1.5))))]
        for i in range(args.n):
            resp = [rng.randrange(3, vocab) for _ in range(max(1, int(args.response_len * rng.uniform(0.25, 1.75))))]
            out.append(Sample(uid=f"{g}-{i}", group_id=str(g), prompt_ids=prompt, response_ids=resp,
                              rollout_logprobs=[-5.0] * len(resp), token_versions=[0] * len(resp),
                              reward=float(i % 2)))
    return out


#: SmolLM2-135M's shape (HF ``HuggingFaceTB/SmolLM2-135M``'s config.json), random weights.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    initializer_range=0.041666666666666664, bos_token_id=1, eos_token_id=2, pad_token_id=2)
#: Bench backend name -> (trainer.backend, trainer.packed, trainer.compile, trainer.kernels, trainer.cuda_graphs).
BACKENDS = {"torch": ("torch", True, False, "eager", False), "torch_padded": ("torch", False, False, "eager", False),
            "torch_compiled": ("torch", True, True, "eager", False),
            "torch_liger": ("torch", True, False, "liger", False),
            "torch_graphs": ("torch", True, False, "eager", True),
            "torch_liger_graphs": ("torch", True, False, "liger", True),
            "megatron": ("megatron", False, False, "eager", False)}


def _build_model(out: str, args: argparse.Namespace) -> str:
    """Write the benchmarked model directory into ``out``; returns its label."""
    if args.shape == "smollm2-135m":
        import torch
        import transformers

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_135M))
        model.to(getattr(torch, args.dtype)).save_pretrained(out, safe_serialization=True)
        return "SmolLM2-135M shape (Llama, random weights)"
    shape = ["--shape", args.shape, "--dtype", args.dtype]
    subprocess.run([sys.executable, "-m", "bench.make_model", "--out", out, *shape], check=True, capture_output=True)
    return f"bench.make_model {args.shape}"


def _make_backend(name: str, model_dir: str, args: argparse.Namespace) -> Any:
    from actors.backends import TrainerConfig, make_backend
    from policies.losses import make_loss

    if name not in BACKENDS:
        raise SystemExit(f"--backends: {name!r} is unknown (known: {', '.join(BACKENDS)})")
    backend_type, packed, compile, kernels, graphs = BACKENDS[name]
    cfg = TrainerConfig(backend=backend_type, device=args.device, dtype=args.dtype, lr=1e-6,
                        micro_batch_tokens=args.micro_batch_tokens, packed=packed,
                        logprob_chunk_tokens=args.logprob_chunk_tokens, compile=compile, kernels=kernels,
                        cuda_graphs=graphs)
    backend = make_backend(cfg, model_dir, seed=0, loss=make_loss("ppo_clip"))
    backend.setup()
    return backend


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _profile(backend: Any, batch: list[Any], adv: list[float], device: str) -> dict[str, Any]:
    """One profiled step: its busiest ops, and on CUDA what it launched (``kernels``: device
    kernels, memcpy and memset included; ``device_busy_ms``: their summed device time, which
    next to ``step_ms`` says whether the step waits on the device or on the host that
    launches) and ``syncs``: host-device synchronisations (torch's sync debug mode, one
    more unprofiled step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        backend.train_step(batch, adv)
        _sync(device)
    key = "device_time_total" if cuda else "cpu_time_total"
    top = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))[:40]
    out: dict[str, Any] = {"top": [{"op": e.key[:60], "ms": round(getattr(e, key) / 1e3, 2), "count": e.count}
                                   for e in top]}
    if cuda:
        on_device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["kernels"] = len(on_device)
        out["device_busy_ms"] = round(sum(e.device_time for e in on_device) / 1e3, 2)
        out["syncs"] = _count_syncs(lambda: backend.train_step(batch, adv))
    return out


def _count_syncs(step: Any) -> int:
    """Calls that waited for the device during ``step()`` (torch's sync debug mode warns on each)."""
    import warnings

    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backends", default="torch,torch_padded",
                   help="comma list: torch (packed), torch_padded, torch_compiled, torch_liger (CUDA only), "
                        "torch_graphs, torch_liger_graphs (CUDA only), "
                        "megatron (CUDA only)")
    p.add_argument("--small", action="store_true", help="the tiny model in fp32 (a CPU smoke test)")
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "smollm2-135m", "tiny"])
    p.add_argument("--logprob-chunk-tokens", type=int, default=2048)
    p.add_argument("--model", help="a model directory (default: built by bench.make_model)")
    p.add_argument("--groups", type=int, default=None, help="default 8 (--small: 2)")
    p.add_argument("--n", type=int, default=None, help="default 8 (--small: 4)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (--small: 32)")
    p.add_argument("--response-len", type=int, default=None, help="default 256 (--small: 64)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    if not args.small and not args.device.startswith("cuda") and args.shape != "tiny":
        p.error(f"--shape {args.shape} in bf16 is a GPU benchmark (tens of GiB on a CPU); "
                "use --device cuda, or --small for a CPU smoke test")
    # --small is a smoke test on a shared CPU: a batch of a few thousand tokens unless told otherwise
    for key, full, small in (("groups", 8, 2), ("n", 8, 4), ("prompt_len", 128, 32), ("response_len", 256, 64)):
        if getattr(args, key) is None:
            setattr(args, key, small if args.small else full)
    args.dtype = "float32" if args.small else "bfloat16"
    args.shape = "tiny" if args.small else args.shape
    names = args.backends.split(",")

    import torch
    import transformers

    from actors.backends.flops import FlopsModel, peak_flops

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tmp
        label = args.model or _build_model(tmp, args)
        vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        flops = FlopsModel.from_model_dir(model_dir)
        backends = {name: _make_backend(name, model_dir, args) for name in names}
        rng = random.Random(0)
        batches = [_batch(rng, vocab, args) for _ in range(args.steps)]
        adv = [(-1.0) ** i for i in range(args.groups * args.n)]
        for backend in backends.values():  # a compiled backend compiles here, untimed; a graphed one
            # captures a graph for every batch's shape (each batch once at least)
            graphed = getattr(backend, "cuda_graphs", False)
            for i in range(max(args.warmup, len(batches)) if graphed else args.warmup):
                backend.train_step(batches[i % len(batches)], adv)
        warm_graphs = {name: getattr(b, "compiled_graphs", 0) for name, b in backends.items()}
        warm_captures = {name: len(b._graphs.graphs) for name, b in backends.items() if getattr(b, "_graphs", None)}
        times: dict[str, list[float]] = {name: [] for name in names}
        memory = {name: {"peak_gib": 0.0, "step_peak_gib": 0.0} for name in names}
        cuda = args.device.startswith("cuda")
        for _ in range(args.repeats):
            for name, backend in backends.items():
                _sync(args.device)
                if cuda:
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                for batch in batches:
                    backend.train_step(batch, adv)
                _sync(args.device)
                times[name].append((time.perf_counter() - t0) / len(batches))
                if cuda:
                    top = torch.cuda.max_memory_allocated()
                    memory[name]["peak_gib"] = max(memory[name]["peak_gib"], top / 2**30)
                    memory[name]["step_peak_gib"] = max(memory[name]["step_peak_gib"], (top - base) / 2**30)
        seq_lens = [len(s.prompt_ids) + len(s.response_ids) for b in batches for s in b]
        step_flops = flops.train_flops(seq_lens) / len(batches)
        response_tokens = sum(len(s.response_ids) for b in batches for s in b) / len(batches)
        peak = peak_flops(args.device, args.dtype)
        out: dict[str, Any] = {
            "machine": {"host": platform.node(), "device": torch.cuda.get_device_name() if cuda
                        else platform.processor() or platform.machine(), "torch": torch.__version__,
                        "transformers": transformers.__version__},
            "model": {"dir": label, "vocab": vocab,
                      "params": sum(t.numel() for t in {id(t): t for t in backends[names[0]].named_weights().values()}.values()), "matmul_params": flops.matmul_params, "dtype": args.dtype},
            "batch": {"samples": args.groups * args.n, "tokens_mean": sum(seq_lens) / len(seq_lens),
                      "response_tokens": response_tokens, "micro_batch_tokens": args.micro_batch_tokens,
                      "logprob_chunk_tokens": args.logprob_chunk_tokens},
            "peak_tflops": peak / 1e12 if peak else None,
            "backends": {},
        }
        first = statistics.median(times[names[0]])
        for name in names:
            step = statistics.median(times[name])
            out["backends"][name] = {
                "packed": getattr(backends[name], "packed", False),
                "padded_reason": getattr(backends[name], "padded_reason", None),
                "step_ms": [round(t * 1e3, 2) for t in times[name]],
                "response_tokens_per_s": response_tokens / step,
                "tokens_per_s": sum(seq_lens) / len(batches) / step,
                "tflops": step_flops / step / 1e12,
                "mfu": step_flops / step / peak if peak else None,
                **({k: round(v, 3) for k, v in memory[name].items()} if cuda else {}),
                "step_over_first": step / first,
            }
            if getattr(backends[name], "compile", False):
                graphs = backends[name].compiled_graphs
                out["backends"][name].update(compile_s=round(backends[name].compile_s, 2), compiled_graphs=graphs,
                                             graphs_compiled_while_timed=graphs - warm_graphs[name])
            if name in warm_captures:
                g = backends[name]._graphs
                out["backends"][name].update(graph_capture_s=round(g.capture_s, 2), cuda_graphs=len(g.graphs),
                                             graphs_captured_while_timed=len(g.graphs) - warm_captures[name])
            if args.profile:
                out["backends"][name]["profile"] = _profile(backends[name], batches[0], adv, args.device)
        if "torch" in times and "torch_padded" in times:
            out["speedup_vs_padded"] = statistics.median(times["torch_padded"]) / statistics.median(times["torch"])
        for name in ("torch_compiled", "torch_liger", "torch_graphs", "torch_liger_graphs"):
            if "torch" in times and name in times:
                key = "speedup_compiled" if name == "torch_compiled" else "speedup_" + name.removeprefix("torch_")
                out[key] = statistics.median(times["torch"]) / statistics.median(times[name])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
