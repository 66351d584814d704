"""Optimizer benchmark: AdamW against Muon + AdamW (``trainer.optimizer``), one step.

    python -m bench.optimizer --device cuda --out bench/results/optimizer_h100_qwen05b.json
    python -m bench.optimizer --small                     # CPU smoke test: a small shape, fp32

Builds the model from a config, no files (``--shape``: ``qwen2.5-0.5b``, Qwen2.5-0.5B
with its 151936-token tied embedding, 494M parameters; ``smollm2-135m``; ``--small``: a
tiny Qwen2, fp32 on the CPU), in the trainer's dtype (bf16 on CUDA with fp32 main
params, as ``trainer.dtype: auto`` and ``trainer.master_dtype`` run it), gives every
param a seeded random gradient and times the optimizer step the torch backend runs:
``actors.backends.optimizers.build_optimizer``'s optimizer, clip to norm 1 and step
(with fp32 main params: the grads cast, clipped, stepped, written back). Both
optimizers run in this one process, each on a fresh model, AdamW first; each step
time is the median of ``--repeats`` steps after ``--warmup`` (synchronized).

Prints one JSON object: per optimizer, the bytes of its state tensors (AdamW's
``exp_avg``, ``exp_avg_sq``, ``step``; Muon's ``momentum_buffer``), of the fp32 main params
(the same for both), and on CUDA what a step leaves allocated beyond the model and its
grads (state and main params) and its peak above them (``torch.cuda.max_memory_allocated``:
the flat main-grad buffer, Newton-Schulz's workspace); the step's median and every
repeat's milliseconds; and ``ratios``, Muon's figure over AdamW's.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch
import transformers

from actors.backends.config import MuonConfig
from actors.backends.mixed_precision import MainParamsOptimizer
from actors.backends.optimizers import build_optimizer, muon_mask

#: Model shapes (Qwen2 / Llama configs with their real vocabularies, tied heads).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "smollm2-135m": dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152),
    "tiny": dict(arch="qwen2", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=4096),
}
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_model(shape: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A random-weight causal LM of ``shape`` on ``device`` in ``dtype``."""
    dims = dict(SHAPES[shape])
    arch = dims.pop("arch")
    cls: Any = transformers.Qwen2ForCausalLM if arch == "qwen2" else transformers.LlamaForCausalLM
    config_cls: Any = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    config = config_cls(tie_word_embeddings=True, max_position_embeddings=4096, **dims)
    torch.manual_seed(0)
    with torch.device(device):
        return cls(config).to(dtype)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _state_bytes(optimizer: Any) -> tuple[int, int]:
    """(bytes of the optimizer's state tensors, bytes of its main params: 0 without them)."""
    main = 0
    if isinstance(optimizer, MainParamsOptimizer):
        main = sum(m.numel() * m.element_size() for m in optimizer.main)
        optimizer = optimizer.optimizer
    state = optimizer.state_dict()["state"]
    return sum(v.numel() * v.element_size() for st in state.values() for v in st.values()
               if isinstance(v, torch.Tensor)), main


def measure(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build a fresh model and ``kind``'s optimizer; time its steps; count its memory."""
    device, dtype = args.device, _DTYPES[args.dtype]
    model = build_model(args.shape, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 1e-3 for p in model.parameters()]
    params = list(model.parameters())
    _sync(device)
    cuda = device.startswith("cuda")
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # the model and the grads kept to reassign each step
    master = torch.float32 if dtype != torch.float32 else None
    muon = MuonConfig(adjust_lr=args.adjust_lr) if kind == "muon" else None
    optimizer = build_optimizer(model, lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, muon=muon, fused=cuda,
                                sharded=False, master_dtype=master)

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        if isinstance(optimizer, MainParamsOptimizer):
            optimizer.clip_and_step(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()

    times_ms = []
    for i in range(args.warmup + args.repeats):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= args.warmup:
            times_ms.append((time.perf_counter() - t0) * 1e3)
    state, main = _state_bytes(optimizer)
    out: dict[str, Any] = {"state_bytes": state, "main_param_bytes": main, "optimizer_bytes": state + main,
                           "step_ms": statistics.median(times_ms), "step_ms_all": [round(t, 3) for t in times_ms]}
    if cuda:
        optimizer.zero_grad(set_to_none=True)  # as the next step begins: the main grads go, the state stays
        out["cuda_resident_bytes"] = torch.cuda.memory_allocated() - base
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    if kind == "muon":
        mask = muon_mask(model)
        out["muon_params"] = sum(p.numel() for p, m in zip(params, mask) if m)
    del optimizer, model, grads, params
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    p.add_argument("--small", action="store_true", help="the tiny shape in fp32 (a CPU smoke test)")
    p.add_argument("--dtype", default=None, choices=list(_DTYPES),
                   help="the model's (default: bfloat16 on CUDA, with fp32 main params; float32 elsewhere)")
    p.add_argument("--adjust-lr", default=MuonConfig().adjust_lr,
                   choices=["match_rms_adamw", "match_adamw_update_rms", "original"])
    p.add_argument("--repeats", type=int, default=None, help="default 20 (--small: 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    if args.small:
        args.shape = "tiny"
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.repeats = args.repeats or (5 if args.small else 20)
    result: dict[str, Any] = {
        "bench": "optimizer", "shape": args.shape, "device": args.device, "dtype": args.dtype,
        "master_dtype": "float32" if args.dtype != "float32" else None, "adjust_lr": args.adjust_lr,
        "repeats": args.repeats, "warmup": args.warmup, "torch": torch.__version__, "python": platform.python_version(),
    }
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    else:
        result["cpu_threads"] = torch.get_num_threads()
    adamw, muon = measure("adamw", args), measure("muon", args)
    result["params"] = sum(p.numel() for p in build_model(args.shape, _DTYPES[args.dtype], "meta").parameters())
    result.update(adamw=adamw, muon=muon)
    result["ratios"] = {k: round(muon[k] / adamw[k], 4) for k in adamw
                        if isinstance(adamw[k], (int, float)) and adamw[k] and k in muon}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
