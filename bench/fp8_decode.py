"""Decode throughput and push time of the built-in engine with FP8 linears
(``rollout.engine.weight_dtype: fp8``) against the same engine in bf16, in one run.

    python -m bench.fp8_decode                      # one H100: Qwen2.5-0.5B and 1.5B shapes, batch 64 and 256
    python -m bench.fp8_decode --shape qwen2.5-0.5b --batch 64
    python -m bench.fp8_decode --compile-decode     # both sides with rollout.engine.compile_decode (batches > 64)
    python -m bench.fp8_decode --fp8-skip q_proj    # the FP8 side with rollout.engine.fp8_skip
    python -m bench.fp8_decode --smoke              # CPU: the tiny model, reference GEMM (checks the JSON only)

Prints one JSON object (and writes it to ``--out`` when given). Each shape is built locally
with random weights (seeded; Qwen2.5's body and its 151936-token tied embedding, so the head
costs what it costs in the real model). For each shape, one engine per contender (bf16, fp8),
CUDA graphs on (every batch bucket captured at setup), ``max_num_seqs`` the largest batch;
per batch size the same random prompts of ``--prompt-len`` tokens, exactly ``--new-tokens``
new tokens each, sampled at T=1, one untimed run first (warm), then the timed one: tokens/s
are new tokens over wall time from submitting the batch to its last token, prefill included.
``fp8_over_bf16`` is the ratio of the two. The push time is the engine's apply of a full
update (``swap_weights``' ``apply_ms``: written, checked and, for fp8, re-quantized, until the
device is done) over ``--pushes`` pushes, each of slightly changed weights, sent through
``sync.WeightSender`` from tensors on the engine's device; its median and every push.

``--smoke`` runs the tiny checked-in model on the CPU with fp32 as the baseline and the FP8
reference GEMM (``fp8_reference_for_tests``): a check of the benchmark's code and keys,
never a figure.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import tempfile
import time

import safetensors.torch
import torch
import transformers

import loop
import sync
from actors.engines.torch_engine import TorchEngine
from bench import emit
from bench.engine import _run_batch
from bench.make_model import random_weights

#: Qwen2.5's bodies with their real (tied) vocabulary.
SHAPES: dict[str, dict[str, int]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
}
TINY = pathlib.Path(__file__).resolve().parents[1] / "actors" / "assets" / "tiny-qwen2"


def build_model(shape: str, path: str, seed: int = 0) -> str:
    """Write a random-weight bf16 Qwen2 directory of ``shape`` at ``path`` (config + safetensors)."""
    body = SHAPES[shape]
    cfg = transformers.Qwen2Config(**body, head_dim=body["hidden_size"] // body["num_attention_heads"],
                                   max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
                                   rms_norm_eps=1e-6, initializer_range=0.02, use_sliding_window=False,
                                   architectures=["Qwen2ForCausalLM"])
    os.makedirs(path, exist_ok=True)
    safetensors.torch.save_file(random_weights(cfg, torch.bfloat16, seed), os.path.join(path, "model.safetensors"),
                                metadata={"format": "pt"})
    cfg.save_pretrained(path)
    return path


async def measure(path: str, weight_dtype: str, batches: list[int], prompt_len: int, new_tokens: int,
                  device: str, pushes: int, smoke: bool, **options) -> dict:
    """Tokens/s per batch size and push times of one engine (``weight_dtype`` auto | fp8;
    ``options``: more of :class:`TorchEngine`'s keywords)."""
    cuda = device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    engine = TorchEngine(path, device=device, dtype=dtype, weight_dtype=weight_dtype, max_num_seqs=max(batches),
                         max_model_len=prompt_len + new_tokens, cuda_graphs=cuda, fp8_reference_for_tests=smoke,
                         **options)
    t0 = time.perf_counter()
    await engine.setup()
    setup_s = time.perf_counter() - t0
    try:
        vocab = engine._core.cfg.vocab_size
        tokens_per_s = {}
        for batch in batches:
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(1, vocab, (batch, prompt_len), generator=g).tolist()
            await _run_batch(engine, prompts, [new_tokens] * batch, f"warm{batch}")
            tokens_per_s[str(batch)] = round(await _run_batch(engine, prompts, [new_tokens] * batch, f"t{batch}"), 1)
        sender = sync.WeightSender(mode="full", dtype=getattr(torch, dtype))
        state = {k: v.clone() for k, v in engine.named_weights().items() if k != "lm_head.weight"}
        push_ms = []
        for version in range(1, pushes + 1):
            for t in state.values():  # every push carries other values (norms and biases too)
                t.mul_(1.0 + 2.0**-7)
            report = await engine.swap_weights(sender.encode(state, version), "abort")
            push_ms.append(round(report.apply_ms, 2))
        stats = engine.statistics()
    finally:
        await engine.close()
    del state
    if cuda:
        torch.cuda.empty_cache()
    return {"tokens_per_s": tokens_per_s, "push_apply_ms": round(statistics.median(push_ms), 2), "push_apply_ms_all": push_ms,
            "weights_bytes": stats["weights_bytes"], "kv_cache_bytes": stats["kv_cache_bytes"],
            "fp8_kernel": stats.get("fp8_kernel"), "fp8_refits_refused": stats.get("fp8_refits_refused"),
            "setup_s": round(setup_s, 2), "graph_capture_s": round(float(stats["graph_capture_s"]), 2)}


def run(shapes: list[str], batches: list[int], prompt_len: int, new_tokens: int, device: str, pushes: int,
        smoke: bool, root: str, compile_decode: bool = False, fp8_skip: tuple[str, ...] = ()) -> dict:
    result: dict = {}
    for shape in shapes:
        t0 = time.perf_counter()
        path = str(TINY) if smoke else build_model(shape, os.path.join(root, shape))
        row: dict = {"build_s": round(time.perf_counter() - t0, 2)}
        for label, weight_dtype, options in (("bf16", "auto", {}), ("fp8", "fp8", {"fp8_skip": fp8_skip})):
            row[label] = loop.run(measure(path, weight_dtype, batches, prompt_len, new_tokens, device, pushes, smoke,
                                          compile_decode=compile_decode, **options))
        row["fp8_over_bf16"] = {b: round(row["fp8"]["tokens_per_s"][b] / row["bf16"]["tokens_per_s"][b], 3)
                                for b in row["bf16"]["tokens_per_s"]}
        result[shape] = row
        if not smoke:
            os.remove(os.path.join(path, "model.safetensors"))
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=sorted(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--pushes", type=int, default=3, help="full pushes timed per engine")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model, few tokens: checks the code and keys")
    ap.add_argument("--compile-decode", action="store_true", help="rollout.engine.compile_decode on both sides")
    ap.add_argument("--fp8-skip", nargs="*", default=[], help="rollout.engine.fp8_skip patterns (the fp8 side)")
    ap.add_argument("--machine", default=None, help="free text saved with the result")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.batch, args.prompt_len, args.new_tokens, args.pushes = "cpu", [2, 4], 4, 4, 2
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available (--smoke runs on a CPU)")
    shapes = ["tiny-qwen2"] if args.smoke else args.shape
    machine = args.machine or (torch.cuda.get_device_name() if cuda else f"{platform.machine()}, {os.cpu_count()} cores")
    result: dict = {"bench": "fp8_decode", "machine": machine, "device": args.device, "torch": torch.__version__,
                    "smoke": args.smoke, "dtype": "bfloat16" if cuda else "float32", "batches": args.batch,
                    "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "sampling": "T=1, fixed length",
                    "cuda_graphs": cuda, "pushes": args.pushes, "compile_decode": args.compile_decode,
                    "fp8_skip": args.fp8_skip}
    with tempfile.TemporaryDirectory() as root:
        result["shapes"] = run(shapes, args.batch, args.prompt_len, args.new_tokens, args.device, args.pushes,
                               args.smoke, root, args.compile_decode, tuple(args.fp8_skip))
    emit(result, args.out, indent=2)
    return result


if __name__ == "__main__":
    main()
