"""Final reward vs maximum staleness, plain PPO vs decoupled PPO (the shape of
AReaL's staleness ablation, at small scale).

    python -m bench.staleness [--staleness 0,1,2,4,8] [--steps 200] [--seeds 2]

For a bound k, the fully-async policy admits up to (1 + k) batches ahead of
training (``policy.staleness_threshold=k``) and the trainer drops anything
more than k versions old (``policy.max_staleness=k``); k = 0 is the
synchronous on-policy run. Each (loss, k) trains the same model on the same
task for the same number of steps. Prints one JSON object and writes a PNG
plot next to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
from typing import Any

from actors.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _one(loss: str, k: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    policy = ["policy.type=sync"] if k == 0 else [
        "policy.type=fully_async", f"policy.staleness_threshold={k}", f"policy.max_staleness={k}"]
    run = launch(ROOT / "fully_async.yaml", f"run.seed={seed}", f"run.total_steps={args.steps}",
                 "run.progress=false", f"run.output_dir={args.output_dir}", f"trainer.loss={loss}",
                 f"trainer.lr={args.lr}", *policy, *args.overrides)
    with run:
        hist = run.train(args.steps)
    tail = max(1, len(hist) // 10)
    return {
        "final_reward": sum(m["reward"] for m in hist[-tail:]) / tail,
        "staleness_mean": statistics.fmean(m["staleness_mean"] for m in hist),
        "staleness_max": max(m["staleness_max"] for m in hist),
        "dropped": hist[-1]["dropped"],
    }


def _plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for loss, rows in result["losses"].items():
        ks = [r["max_staleness"] for r in rows]
        means = [r["final_reward"]["mean"] for r in rows]
        errs = [r["final_reward"]["spread"] / 2 for r in rows]
        ax.errorbar(ks, means, yerr=errs, marker="o", capsize=3, label=loss)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(result["staleness"], [str(k) for k in result["staleness"]])
    ax.set_xlabel("max staleness (versions)")
    ax.set_ylabel(f"final reward (last 10% of {result['steps']} steps)")
    ax.set_title(f"{result['task']}, {result['seeds']} seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--staleness", default="0,1,2,4,8")
    p.add_argument("--losses", default="ppo_clip,decoupled_ppo")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--output-dir", default="/tmp/asyncrl-bench-runs")
    p.add_argument("--out", default=None, help="also write the JSON here (the kept one: bench/results/staleness/staleness_cpu.json)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = p.parse_args(argv)
    ks = [int(k) for k in args.staleness.split(",")]
    result: dict[str, Any] = {
        "bench": "staleness", "machine": f"{platform.node()} {platform.machine()}", "task": "reverse_digits",
        "steps": args.steps, "seeds": args.seeds, "lr": args.lr, "staleness": ks, "losses": {},
    }
    for loss in args.losses.split(","):
        rows = []
        for k in ks:
            runs = [_one(loss, k, seed, args) for seed in range(args.seeds)]
            rewards = [r["final_reward"] for r in runs]
            rows.append({"max_staleness": k, "runs": runs,
                         "final_reward": {"mean": statistics.fmean(rewards),
                                          "spread": max(rewards) - min(rewards)}})
            print(f"[staleness] {loss} k={k}: {rewards}", file=sys.stderr)
        result["losses"][loss] = rows
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        try:
            _plot(result, out.with_suffix(".png"))
        except ImportError:  # the JSON is the result; the picture is optional
            print("[staleness] no plot: matplotlib is not installed (pip install -e \".[plot]\")", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
