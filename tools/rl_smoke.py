"""A small synchronous GRPO loop: proof that the model, task, loss and backend learn.

    python -m tools.rl_smoke --steps 400 --seed 0

Each step: sample ``--prompts`` prompts, generate ``--group`` responses each
with HF ``generate(do_sample=True)`` on the trainer's own weights (so it is
exactly on-policy), score them, compute GRPO advantages, one ``train_step``.
Prints one JSON line: mean reward over the first and last 10% of steps, the
gain, and the wall time. No actors, no queue — this is the yardstick the
asynchronous system is held to.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from actors.backends.torch_backend import TorchBackend
from actors.models import BUILTIN_MODEL_DIR
from policies.advantages import grpo_advantages
from policies.losses import make_loss
from policies.tasks import Task, make_task
from contracts.sample import Sample


@torch.no_grad()
def generate_group_samples(model, task: Task, prompts, *, group: int, max_new_tokens: int, temperature: float, step: int, version: int) -> list[Sample]:
    """``group`` sampled responses per prompt, with their rollout log-probs and rewards."""
    rows = [p for p in prompts for _ in range(group)]
    width = max(len(p.prompt_ids) for p in rows)
    pad_id = model.config.pad_token_id
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(rows):  # left padding: every prompt ends at the same column
        ids[i, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
        attn[i, width - len(p.prompt_ids) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(task.stop_token_ids),
        pad_token_id=pad_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, width:]  # [N, T]
    logp = torch.stack([torch.log_softmax(l.float() / temperature, -1) for l in out.logits], 1)  # [N, T, V]
    tok_logp = torch.gather(logp, 2, new.unsqueeze(-1)).squeeze(-1)
    samples = []
    for i, p in enumerate(rows):
        resp, lps = [], []
        finish = "length"
        for t in range(new.shape[1]):
            tok = int(new[i, t])
            resp.append(tok)
            lps.append(float(tok_logp[i, t]))
            if tok in task.stop_token_ids:
                finish = "stop"
                break
        samples.append(
            Sample(
                uid=f"{step}-{i}",
                group_id=f"{step}-{i // group}",
                prompt_ids=list(p.prompt_ids),
                response_ids=resp,
                rollout_logprobs=lps,
                token_versions=[version] * len(resp),
                reward=task.reward(p.meta, resp),
                finish_reason=finish,
                meta=dict(p.meta),
            )
        )
    return samples


def run(*, model: str, task: str, steps: int, prompts: int, group: int, lr: float, max_new_tokens: int, temperature: float, seed: int, loss: str = "ppo_clip", task_kwargs: dict | None = None) -> dict:
    """Run the loop and return the summary dict (see the module docstring)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # the whole batch in one pass (micro_batch_tokens=0), as when its README's figures were measured
    backend = TorchBackend(model, loss=make_loss(loss), lr=lr, seed=seed, grad_clip=1.0, micro_batch_tokens=0)
    backend.setup()
    the_task = make_task(task, tokenizer=None if model == str(BUILTIN_MODEL_DIR) else _tokenizer(model), **(task_kwargs or {}))
    rewards, lengths = [], []
    for step in range(steps):
        batch = generate_group_samples(
            backend.model, the_task, the_task.sample_prompts(rng, prompts),
            group=group, max_new_tokens=max_new_tokens, temperature=temperature, step=step, version=backend.version,
        )
        r = torch.tensor([s.reward for s in batch])
        adv = grpo_advantages(r, torch.arange(len(batch)) // group)
        backend.train_step(batch, adv.tolist())
        rewards.append(float(r.mean()))
        lengths.append(sum(len(s.response_ids) for s in batch) / len(batch))
    k = max(1, steps // 10)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return {
        "task": task, "task_kwargs": task_kwargs or {}, "seed": seed, "steps": steps, "prompts": prompts, "group": group, "lr": lr,
        "max_new_tokens": max_new_tokens, "temperature": temperature, "loss": loss,
        "first10_reward": round(first, 4), "last10_reward": round(last, 4), "gain": round(last - first, 4),
        "mean_response_tokens": round(sum(lengths) / len(lengths), 2),
        # Mean reward of each tenth of the run, to see the shape of the curve.
        "curve": [round(sum(rewards[i * k : (i + 1) * k]) / k, 3) for i in range(min(10, steps // k))],
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _tokenizer(model: str):
    from actors.models import load_tokenizer

    return load_tokenizer(model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(BUILTIN_MODEL_DIR))
    parser.add_argument("--task", default="reverse_digits")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--loss", default="ppo_clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task-kwargs", type=json.loads, default={}, help='JSON options for the task, e.g. \'{"max_len": 5}\'')
    args = parser.parse_args(argv)
    print(json.dumps(run(
        model=args.model, task=args.task, steps=args.steps, prompts=args.prompts, group=args.group, lr=args.lr,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, loss=args.loss, task_kwargs=args.task_kwargs,
    )))


if __name__ == "__main__":
    main()
