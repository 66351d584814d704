"""Supervised warm start of a model directory on a text task, so RL has something to lift.

    python -m tools.sft_text --model /tmp/q05-smol --task text_arithmetic \
        --task-kwargs '{"digits": 2, "ops": "+"}' --steps 600 --batch-size 64 --lr 3e-4 \
        --device cuda --dtype bfloat16

A random-weight model (``bench.make_model``) scores 0 on a text task: it never
writes a number and stops. A minute of supervised steps on the task's own
prompts fixes the format and part of the skill, so the held-out eval reward
starts above 0 and RL's gain can be measured.

Each step draws ``--batch-size`` problems from the task's *training* split
(``task.sample_prompts``; the held-out ``eval_prompts`` are never trained on),
renders each prompt exactly as the task does (its chat template or raw text),
and puts the loss on the answer tokens only: the ground-truth answer's tokens,
then the first of the task's stop tokens (the tokenizer's eos, e.g. ChatML's
``<|im_end|>``), which is what ends a response the reward scores. AdamW on
fp32 master weights, ``--dtype bfloat16`` autocasts the compute; linear warm-up
over the first 10% of steps, then constant. Deterministic given ``--seed`` on
one machine (CPU; on a GPU up to its kernels' nondeterminism), unless
``--max-seconds`` cuts training short (a cap for a fixed time budget).

The model is saved (safetensors, in the dtype of its ``config.json``) back to
``--model`` or to ``--out`` (with the tokenizer files). Prints one JSON line:
steps, first and final loss (mean of the last 10 steps), seconds, parameters,
and — unless ``--eval-prompts 0`` — the greedy held-out reward after training
(the score the benchmark's first evaluation will see).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
import time

import torch

from actors.models import load_causal_lm, load_tokenizer
from bench.make_model import copy_tokenizer
from policies.tasks import Prompt, make_task
from tools.warmstart import pad_answers

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def answer_ids(task, meta: dict[str, str]) -> list[int]:
    """The target of one prompt: the answer text's tokens (no special tokens
    added), then the task's first stop token (its reward cuts a response there)."""
    ids = task.tokenizer(meta["answer"], add_special_tokens=False)["input_ids"]
    return list(ids) + [task.stop_token_ids[0]]


def sft_batch(task, prompts: list[Prompt], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, T]`` input ids, attention mask and labels (-100 off the answer)."""
    return pad_answers([(list(p.prompt_ids), answer_ids(task, p.meta)) for p in prompts], pad_id)


@torch.no_grad()
def greedy_eval(model, task, prompts: list[Prompt], *, max_new_tokens: int, batch_size: int = 64) -> float:
    """Mean task reward of one greedy response per prompt (left-padded batches)."""
    device = next(model.parameters()).device
    pad_id = model.config.pad_token_id
    scores = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p.prompt_ids) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
            mask[i, width - len(p.prompt_ids) :] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=list(task.stop_token_ids),
                             pad_token_id=pad_id)
        scores += [task.reward(p.meta, out[i, width:].tolist()) for i, p in enumerate(chunk)]
    return sum(scores) / max(1, len(scores))


def train(model, task, *, steps: int, batch_size: int, lr: float, seed: int, dtype: torch.dtype,
          max_seconds: float = 0.0) -> list[float]:
    """``steps`` supervised steps on training prompts of ``task`` (fewer when
    ``max_seconds`` > 0 runs out first); returns the losses, one per step taken."""
    device = next(model.parameters()).device
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup))
    pad_id = model.config.pad_token_id
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    losses = []
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        if max_seconds and time.perf_counter() - t0 > max_seconds:
            break
        ids, mask, lab = (t.to(device) for t in sft_batch(task, task.sample_prompts(rng, batch_size), pad_id))
        target = lab[:, 1:]  # position p predicts p + 1
        on_answer = target != -100  # [B, T-1]
        with autocast:
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
            logits = model.get_output_embeddings()(hidden[on_answer])  # [num_answer_tokens, V]: the prompt needs no logits
        loss = torch.nn.functional.cross_entropy(logits.float(), target[on_answer])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"the loss is {losses[-1]} at step {len(losses)}; lower --lr")
    model.eval()
    return losses


def run(model_dir: str | pathlib.Path, *, task: str = "text_arithmetic", task_kwargs: dict | None = None,
        steps: int, batch_size: int = 64, lr: float = 3e-4, seed: int = 0, device: str = "cpu",
        dtype: str = "float32", out: str | pathlib.Path | None = None, eval_prompts: int = 64,
        max_new_tokens: int = 16, max_seconds: float = 0.0) -> dict:
    """Warm up the model in ``model_dir`` on ``task`` and save it to ``out``
    (default: ``model_dir``); returns what ``main`` prints."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is unknown (known: {', '.join(_DTYPES)})")
    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got steps={steps}, batch_size={batch_size}")
    torch.manual_seed(seed)
    model_dir = pathlib.Path(model_dir).expanduser().resolve()
    t_task = make_task(task, model_path=str(model_dir), **(task_kwargs or {}))
    if not hasattr(t_task, "render"):
        raise ValueError(f"task {task!r} is not a text task (tools.warmstart warms up the symbol tasks)")
    saved = json.loads((model_dir / "config.json").read_text())
    save_dtype = getattr(torch, str(saved.get("dtype") or saved.get("torch_dtype") or "float32"))
    model = load_causal_lm(model_dir, device=device, dtype=torch.float32)  # fp32 master weights
    if model.config.pad_token_id is None:
        model.config.pad_token_id = t_task.tokenizer.pad_token_id or t_task.stop_token_ids[0]
    t0 = time.perf_counter()
    losses = train(model, t_task, steps=steps, batch_size=batch_size, lr=lr, seed=seed, dtype=_DTYPES[dtype],
                   max_seconds=max_seconds)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    result = {
        "model": str(model_dir), "task": task, "task_kwargs": task_kwargs or {}, "steps": len(losses),
        "batch_size": batch_size, "lr": lr, "seed": seed, "device": device, "dtype": dtype,
        "num_params": sum(p.numel() for p in model.parameters()),
        "first_loss": round(losses[0], 4) if losses else None,
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4) if losses else None,
        "train_s": round(train_s, 2),
    }
    if eval_prompts:
        t1 = time.perf_counter()
        with torch.autocast(model.device.type, dtype=_DTYPES[dtype], enabled=dtype != "float32"):
            result["eval_reward"] = round(greedy_eval(model, t_task, t_task.eval_prompts(eval_prompts),
                                                      max_new_tokens=max_new_tokens), 4)
        result["eval_prompts"] = eval_prompts
        result["eval_s"] = round(time.perf_counter() - t1, 2)
    target = model_dir if out is None else pathlib.Path(out).expanduser().resolve()
    if target != model_dir:
        copy_tokenizer(model_dir, target)
    model.to(save_dtype).save_pretrained(target, safe_serialization=True)
    load_tokenizer(target)  # the directory still loads as a whole
    result["out"] = str(target)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (config, weights, tokenizer) to warm up")
    p.add_argument("--out", default=None, help="write the warmed-up model here (default: back into --model)")
    p.add_argument("--task", default="text_arithmetic")
    p.add_argument("--task-kwargs", default="{}", help="the task's options as a JSON object, as in task.kwargs")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (linear warm-up over 10%% of steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="compute dtype (autocast)")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts scored after training (0: none)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="longest greedy response in that evaluation")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="stop training after this many seconds even before --steps (0: no limit); the "
                        "steps taken are printed (a time limit makes the result depend on the machine)")
    args = p.parse_args(argv)
    try:
        kwargs = json.loads(args.task_kwargs)
    except json.JSONDecodeError as e:
        p.error(f"--task-kwargs is not JSON: {e}")
    if not isinstance(kwargs, dict):
        p.error(f"--task-kwargs must be a JSON object, got {args.task_kwargs!r}")
    print(json.dumps(run(args.model, task=args.task, task_kwargs=kwargs, steps=args.steps,
                         batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device,
                         dtype=args.dtype, out=args.out, eval_prompts=args.eval_prompts,
                         max_new_tokens=args.max_new_tokens, max_seconds=args.max_seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
