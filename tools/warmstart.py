"""Build the built-in tiny Qwen2 model and tokenizer, and warm it up.

    python -m tools.warmstart --out actors/assets/tiny-qwen2 --steps 400 --seed 0 --label-smoothing 0.5

1. A one-token-per-symbol tokenizer (``tokenizers`` WordLevel, wrapped in
   ``PreTrainedTokenizerFast``) over the task symbols — digits, operators,
   separators, ``<bos>``/``<eos>``/``<pad>``/``<unk>``
   (:func:`policies.tasks.build_symbol_tokenizer`, which the built-in tasks use too).
2. A real ``Qwen2ForCausalLM`` from ``Qwen2Config``: hidden 128, 2 heads of
   head_dim 64, 1 KV head (GQA), tied embeddings — under 2 MB of fp32.
3. A short supervised warm-up on the built-in tasks (loss on the answer tokens
   only) so the model knows the format — digits, then ``<eos>`` — but is far
   from solving ``reverse_digits``; RL is what lifts it.

Deterministic given ``--seed`` on one machine (same torch build and threads).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import torch
import transformers

from policies.tasks import Prompt, build_symbol_tokenizer, make_task


def build_config(tokenizer, *, num_layers: int = 2) -> transformers.Qwen2Config:
    """The tiny Qwen2 architecture; head_dim 64 like the real models."""
    return transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def sft_batch(task, prompts: list[Prompt], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, T]`` input ids, attention mask and labels (-100 off the answer)."""
    return pad_answers([(list(p.prompt_ids), task.answer_ids(p.meta) + list(task.stop_token_ids[:1]))
                        for p in prompts], pad_id)


def pad_answers(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(prompt ids, answer ids)`` pairs as right-padded ``[B, T]`` input ids,
    attention mask and labels (-100 off the answer)."""
    rows = [prompt + answer for prompt, answer in pairs]
    labels = [[-100] * len(prompt) + answer for prompt, answer in pairs]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(l)] = torch.tensor(l)
        mask[i, : len(r)] = 1
    return ids, mask, lab


def warm_up(model, tasks: list, *, steps: int, seed: int, lr: float = 1e-3, batch_size: int = 64, label_smoothing: float = 0.0) -> list[float]:
    """Supervised steps on answers from ``tasks`` (each batch split evenly); returns the losses.

    ``label_smoothing`` > 0 trains towards a spread-out target, so the model
    ranks the right token first but samples it at temperature 1 only part of
    the time — the gap between "knows" and "reliably does" that RL closes.
    """
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad_id = model.config.pad_token_id
    losses = []
    model.train()
    for _ in range(steps):
        loss = 0.0
        for task in tasks:
            ids, mask, lab = sft_batch(task, task.sample_prompts(rng, batch_size // len(tasks)), pad_id)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # position p predicts p + 1
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=-100, label_smoothing=label_smoothing
            )
            loss = loss + ce / len(tasks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def build(out: pathlib.Path, *, steps: int, seed: int, lr: float = 1e-3, batch_size: int = 64, num_layers: int = 2, label_smoothing: float = 0.0) -> dict:
    """Build, warm up and save the model + tokenizer into ``out``; return a summary."""
    # One thread: multi-threaded CPU reductions may sum in a different order,
    # and the checkpoint must be reproducible from the command in its README.
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tokenizer = build_symbol_tokenizer()
    config = build_config(tokenizer, num_layers=num_layers)
    model = transformers.Qwen2ForCausalLM(config).float()
    tasks = [make_task("reverse_digits", tokenizer=tokenizer, min_len=3, max_len=8), make_task("long_tail_copy", tokenizer=tokenizer, max_len=24)]
    t0 = time.perf_counter()
    losses = warm_up(model, tasks, steps=steps, seed=seed, lr=lr, batch_size=batch_size, label_smoothing=label_smoothing)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {
        "out": str(out),
        "steps": steps,
        "seed": seed,
        "num_params": sum(p.numel() for p in model.parameters()),
        "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="directory to write the HF checkpoint into")
    parser.add_argument("--steps", type=int, default=400, help="supervised warm-up steps (0 = random init)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--label-smoothing", type=float, default=0.5, help="spread of the warm-up target (see warm_up)")
    args = parser.parse_args(argv)
    summary = build(args.out, steps=args.steps, seed=args.seed, lr=args.lr, batch_size=args.batch_size, num_layers=args.num_layers, label_smoothing=args.label_smoothing)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
