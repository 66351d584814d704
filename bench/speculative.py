"""Speculative decoding with MTP drafts against plain decoding, built-in engine,
same prompts and sampling: decode tokens/s of each, their ratio, the drafts'
acceptance rate.

    python -m bench.speculative --model DIR --device cuda                # K from DIR's mtp.* weights
    python -m bench.speculative --model DIR --device cuda --batch 1 8 64 --out bench/results/spec.json
    python -m bench.speculative --smoke                                  # CPU, the tiny model, seconds

``--model``: a checkpoint with ``mtp.{k}.*`` weights (one exported from a run with
``model.mtp_layers`` > 0 after some training steps; without them the modules start
from the spec's initialisation, which drafts poorly). K is the checkpoint's module
count unless ``--mtp-layers`` says. The prompts are the step-by-step task of
``examples/smollm2_gpu.yaml`` (``text_arithmetic``, two 2-digit operands, "+", the
"think step by step" instruction, chat template), its held-out split; each
request samples up to ``--max-tokens`` tokens at ``--temperature`` and stops at the
task's stop tokens. Request i is seeded with ``--seed + i`` in both modes (the
same distribution; the tokens differ, since speculation draws its randomness
otherwise).

Per batch size (``--batch``: the engine's ``max_num_seqs``, all prompts submitted
at once) and mode, after a warm-up generation on the same engine: ``tokens_per_s``
(new tokens over the wall time of the batch, prefill included) and
``decode_tokens_per_s`` (tokens sampled by decode / speculative steps over the
engine thread's turn time less its prefill time). ``speedup``: the ratio of the
decode rates, speculation over plain. ``acceptance_rate``: accepted drafts over
drafts (drafts past a request's last position are not counted);
``mean_tokens_per_spec_step``: 1 + K * acceptance_rate, the tokens a request gains
per speculative step. Beside them the engine's own clocks over the timed run:
``decode_launch_s`` (host time spent issuing decode / speculative steps; near
``turn_s`` less ``prefill_s``, the steps are bound by launching, not by the device),
``forward_s`` and ``sample_s`` (the forward and sampling parts of those steps and of
the prefills). Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import time
from pathlib import Path

import torch
from safetensors import safe_open

import loop
from actors.engines.torch_engine import TorchEngine
from bench import emit
from contracts.rollout import GenerateRequest, SamplingParams
from policies.tasks import make_task

TINY = str(Path(__file__).resolve().parents[1] / "actors" / "assets" / "tiny-qwen2")
# the step-by-step task of examples/smollm2_gpu.yaml (the time-to-quality runs')
TASK = dict(digits=2, num_operands=2, ops="+", chat_template=True,
            instruction="Think step by step, showing your working, then give the final answer as a number "
                        "on the last line.")


def checkpoint_modules(model: str) -> int:
    """The MTP modules (``mtp.{k}.*``) the checkpoint at ``model`` carries."""
    found = set()
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            found |= {int(m.group(1)) for n in sf.keys() if (m := re.match(r"mtp\.(\d+)\.", n))}
    return max(found) + 1 if found else 0


async def _timed(engine: TorchEngine, requests: list[GenerateRequest]) -> dict[str, float]:
    before = engine.statistics()
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(r) for r in requests))
    wall_s = time.perf_counter() - t0
    after = engine.statistics()
    delta = {k: after[k] - before[k] for k in ("turn_s", "prefill_s", "decode_launch_s", "forward_s", "sample_s",
                                                "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens",
                                                "num_decode_steps", "num_prefill_seqs")}
    num_tokens = sum(len(o.token_ids) for o in outs)
    decode_tokens = num_tokens - delta["num_prefill_seqs"]  # each prefill samples one token
    return {"num_tokens": num_tokens, "wall_s": wall_s, "tokens_per_s": num_tokens / wall_s,
            "decode_tokens_per_s": decode_tokens / max(delta["turn_s"] - delta["prefill_s"], 1e-9), **delta}


async def _run_mode(args, prompts: list[list[int]], stop: tuple[int, ...], batch: int, K: int,
                    speculative: str) -> dict[str, float]:
    engine = TorchEngine(args.model, device=args.device, dtype=args.dtype, max_num_seqs=batch,
                         max_model_len=args.max_model_len, seed=args.seed, mtp_layers=K, speculative=speculative)
    await engine.setup()
    try:
        def requests(tag: str, max_tokens: int) -> list[GenerateRequest]:
            return [GenerateRequest(request_id=f"{tag}{i}", prompt_ids=p, max_tokens=max_tokens,
                                    sampling=SamplingParams(temperature=args.temperature, seed=args.seed + i,
                                                            stop_token_ids=stop))
                    for i, p in enumerate(prompts)]

        await _timed(engine, requests("warm", min(args.max_tokens, 32)))  # kernels, allocator, caches
        return await _timed(engine, requests("r", args.max_tokens))
    finally:
        await engine.close()


def run(args) -> dict[str, object]:
    K = args.mtp_layers if args.mtp_layers is not None else checkpoint_modules(args.model)
    if K < 1:
        raise SystemExit(f"--model {args.model!r} has no mtp.* weights: pass --mtp-layers K")
    task = make_task("text_arithmetic", model_path=args.model, **{**TASK, "chat_template": not args.smoke})
    prompts = [p.prompt_ids for p in task.eval_prompts(args.num_prompts)]
    stop = tuple(task.stop_token_ids)
    runs = []
    for batch in args.batch:
        off = loop.run(_run_mode(args, prompts, stop, batch, K, "off"))
        mtp = loop.run(_run_mode(args, prompts, stop, batch, K, "mtp"))
        rate = mtp["num_accepted_draft_tokens"] / max(mtp["num_draft_tokens"], 1)
        runs.append({"batch": batch, "off": off, "mtp": mtp,
                     "speedup": mtp["decode_tokens_per_s"] / off["decode_tokens_per_s"],
                     "acceptance_rate": rate, "mean_tokens_per_spec_step": 1 + K * rate})
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu"
    return {"bench": "speculative", "model": args.model, "device": args.device, "device_name": device,
            "dtype": args.dtype, "mtp_layers": K,
            "task": {"type": "text_arithmetic", **TASK, "chat_template": not args.smoke},
            "num_prompts": len(prompts), "max_tokens": args.max_tokens, "temperature": args.temperature,
            "runs": runs}


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory with mtp.* weights")
    ap.add_argument("--mtp-layers", type=int, default=None, help="K (default: the checkpoint's module count)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[16], help="max_num_seqs values to run")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model, K=2, a few short prompts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.device, args.dtype = args.model or TINY, "cpu", "float32"
        args.mtp_layers = args.mtp_layers or 2
        args.batch, args.num_prompts, args.max_tokens, args.max_model_len = [4], 8, 16, 64
    if args.model is None:
        ap.error("--model is required (or --smoke)")
    result = run(args)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
