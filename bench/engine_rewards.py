"""The default job's learning with each rollout engine, side by side.

    python -m bench.engine_rewards --engines torch,vllm --seeds 2 --steps 30

Runs ``fully_async.yaml`` (the built-in digit-reversal task on the 397k-parameter
model) for ``--steps`` trainer steps per engine and seed, one after the other in
this process, and prints one JSON object: per engine the training reward per
step, the held-out eval reward (``policy.eval_every``) at equal trained samples,
the mean reward of the last 10 steps, and the wall time, each seed's and their
mean and spread. The engines sample with their own random streams, so curves are
compared as distributions over seeds, not step by step.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time
from typing import Any

from actors.engines import EngineConfig, engine_unavailable
from actors.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _one(engine: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    run = launch(ROOT / "fully_async.yaml", f"rollout.engine.type={engine}", f"run.seed={seed}",
                 f"run.total_steps={args.steps}", "run.progress=false", f"run.output_dir={args.output_dir}",
                 f"policy.eval_every={args.eval_every}", f"policy.eval_prompts={args.eval_prompts}", *args.overrides)
    with run:
        t0 = time.perf_counter()
        hist = run.train(args.steps)
        wall = time.perf_counter() - t0
    evals = [(m["eval/at_trained"], m["eval/reward"]) for m in hist if "eval/reward" in m]
    tail = hist[-10:]
    return {"seed": seed, "wall_s": round(wall, 1), "reward": [round(m["reward"], 4) for m in hist],
            "last10_reward": statistics.fmean(m["reward"] for m in tail), "eval": evals,
            "sync_kinds": [m.get("sync/kind") for m in hist]}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"seeds": runs}
    for key in ("last10_reward", "wall_s"):
        values = [r[key] for r in runs]
        out[key] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    finals = [r["eval"][-1][1] for r in runs if r["eval"]]
    if finals:
        out["eval_last"] = {"mean": statistics.fmean(finals), "min": min(finals), "max": max(finals),
                            "at_trained": runs[0]["eval"][-1][0]}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="torch,vllm")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--output-dir", default="/tmp/asyncrl-engine-rewards")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    for engine in engines:  # before any run: a missing engine is one line, not a traceback after the others
        if (reason := engine_unavailable(EngineConfig(type=engine))) is not None:
            p.error(f"--engines {engine}: {reason}")
    runs: dict[str, list] = {e: [] for e in engines}
    for seed in range(args.seeds):
        for engine in engines:
            runs[engine].append(_one(engine, seed, args))
    result = {"bench": "engine_rewards", "machine": f"{platform.machine()} {platform.processor()}",
              "steps": args.steps, "seeds": args.seeds, "overrides": args.overrides,
              "engines": {e: _summary(r) for e, r in runs.items()}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
