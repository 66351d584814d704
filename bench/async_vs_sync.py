"""Fully-async vs synchronous vs one-step-off training, same everything else.

    python -m bench.async_vs_sync                 # CPU, default model, long-tail task, 3 seeds
    python -m bench.async_vs_sync --device cuda   # the same on a GPU
    python -m bench.async_vs_sync --runtime process,local   # each policy under both runtimes: sync cost ratio

Every policy runs the same task, model, engine, trainer, batch size and
number of trainer steps (so the same sample budget), one after the other in
this process, seed by seed (every policy runs seed 0, then seed 1, ...),
each run first taking ``--warmup-steps`` trainer steps untimed: one-time costs (CUDA
context, kernels JIT-compiled or graphs captured per shape, first use of each prefill
shape) land there in whichever processes the actors live, and every policy is timed in
steady state (fully-async starts the timed window with its pipeline full and ends it with
work in flight alike). Prints one JSON object: per policy the wall time of the timed
steps (setup excluded), samples/s, trainer and rollout idle ratios and the final
reward (mean over the last 10% of steps), each as mean and spread over seeds,
and the speedup of each policy over sync. ``fully_async`` syncs weights after
every trainer step like the baselines; ``fully_async_k2`` every second step.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import loop
from actors.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
POLICIES = {
    "sync": ["policy.type=sync"],
    "one_step_off": ["policy.type=one_step_off"],
    "fully_async": ["policy.type=fully_async", "rollout.partial_rollout=true"],
    # the same, syncing weights every 2 trainer steps (half the interruptions)
    # (its window already spans two steps, so it runs half as far ahead per step)
    "fully_async_k2": ["policy.type=fully_async", "rollout.partial_rollout=true",
                       "policy.trigger_parameter_sync_step=2", "policy.staleness_threshold=1"],
}


def _one(policy: str, seed: int, runtime: str, args: argparse.Namespace) -> dict[str, Any]:
    overrides = [
        f"run.seed={seed}", f"run.total_steps={args.warmup_steps + args.steps}", "run.progress=false",
        f"run.output_dir={args.output_dir}", f"task.type={args.task}",
        f"rollout.max_response_tokens={args.max_response_tokens}",
        f"rollout.engine.max_model_len={args.task_max_len + args.max_response_tokens + 16}",
        f"task.kwargs.max_len={args.task_max_len}", f"task.kwargs.tail_alpha={args.tail_alpha}",
        f"trainer.batch_prompts={args.batch_prompts}", f"rollout.n={args.n}",
        f"policy.staleness_threshold={args.staleness_threshold}",
        f"policy.max_staleness={args.max_staleness}",
        f"runtime.type={runtime}", *POLICIES[policy], *args.overrides,
    ]
    if args.device != "cpu":
        engine_device = "cuda:1" if args.placement == "disaggregated" else args.device
        trainer_device = "cuda:0" if args.placement == "disaggregated" else args.device
        overrides += [f"rollout.engine.device={engine_device}", f"trainer.device={trainer_device}",
                      "rollout.engine.dtype=bfloat16", "sync.mode=auto",
                      f"sync.colocated={args.free_kv}"]
    if args.placement == "disaggregated":  # separate processes, weights by broadcast
        overrides += ["sync.colocated=false", "sync.transport=broadcast",
                      f"sync.backend={'gloo' if args.device == 'cpu' else 'nccl'}"]
    run = launch(ROOT / "fully_async.yaml", *overrides)
    transport = run.weight_transport
    with run:
        warm = run.train(args.warmup_steps)  # untimed: one-time costs of the actors' processes land here
        engine0 = loop.run(run.policy.rollouts[0].statistics())
        t0 = time.perf_counter()
        hist = run.train(args.steps)
        wall_s = time.perf_counter() - t0
        engine1 = loop.run(run.policy.rollouts[0].statistics())
    # the engine's counters over the timed steps only (gauges such as num_running: at the end)
    gauges = ("num_running", "num_waiting", "kv_cache_bytes", "weights_bytes")
    engine = {k: v if k in gauges or not isinstance(v, (int, float)) else round(v - engine0.get(k, 0), 4)
              for k, v in engine1.items()}
    k = max(1, len(hist) // 10)
    last = hist[-1]
    start = warm[-1] if warm else {"trained": 0, "elapsed_s": 0.0, "trainer_idle_ratio": 0.0,
                                   "rollout_idle_ratio": 0.0}

    def idle(key: str) -> float:  # over the timed steps (the policy's counters run from its start)
        busy = (1 - last[key]) * last["elapsed_s"] - (1 - start[key]) * start["elapsed_s"]
        return min(1.0, max(0.0, 1.0 - busy / (last["elapsed_s"] - start["elapsed_s"])))
    return {
        "weight_transport": transport,
        "wall_s": wall_s,
        "samples_per_s": (last["trained"] - start["trained"]) / wall_s,
        "tokens_per_s": sum(m["response_len_mean"] for m in hist) * run.cfg.batch_size / wall_s,
        "trainer_idle_ratio": idle("trainer_idle_ratio"),
        "rollout_idle_ratio": idle("rollout_idle_ratio"),
        "final_reward": sum(m["reward"] for m in hist[-k:]) / k,
        "first_reward": sum(m["reward"] for m in hist[:k]) / k,
        "staleness_max": max(m["staleness_max"] for m in hist),
        "response_len_mean": statistics.fmean(m["response_len_mean"] for m in hist),
        "partial_ratio": sum(m["partial_ratio"] for m in hist) / len(hist),
        "dropped": last["dropped"],
        "sync_ms_mean": statistics.fmean(m.get("sync/total_ms", 0.0) for m in hist),
        # where a sync's time goes: encode (trainer), transfer, apply (engine), and the
        # rest of the sequence (pause, abort, version checks, resume: engine round trips);
        # paused: how long the engines stood still (the encode runs before the pause
        # unless the KV cache is freed for the push)
        "sync_parts_ms_mean": _sync_parts(hist),
        "engine": engine,
    }


def _sync_parts(hist: list[dict[str, Any]]) -> dict[str, Any]:
    syncs = [m for m in hist if "sync/total_ms" in m]
    if not syncs:
        return {}
    parts = {k: statistics.fmean(m[f"sync/{k}_ms"] for m in syncs)
             for k in ("encode", "transfer", "apply", "total", "paused")}
    parts["sequence"] = parts["total"] - parts["encode"] - parts["transfer"] - parts["apply"]
    parts = {k: round(v, 2) for k, v in parts.items()}
    parts["kinds"] = dict(collections.Counter(m["sync/kind"] for m in syncs))
    return parts


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"seeds": runs}
    for key in ("wall_s", "samples_per_s", "tokens_per_s", "trainer_idle_ratio", "rollout_idle_ratio",
                "final_reward", "first_reward", "partial_ratio", "sync_ms_mean"):
        values = [r[key] for r in runs]
        out[key] = {"mean": statistics.fmean(values),
                    "spread": (max(values) - min(values)) if len(values) > 1 else 0.0}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--placement", choices=["colocated", "disaggregated"], default="colocated",
                   help="disaggregated: trainer and engine in separate processes (on GPU: cuda:0 "
                        "and cuda:1), weights by torch.distributed broadcast (runtime process or ray)")
    p.add_argument("--runtime", default="process",
                   help="process (default: one child process per actor, so rollout and trainer get a "
                        "core and a GIL each, no Ray) | ray | local (one process, one GIL); a comma list "
                        "runs each policy under each runtime in turn and compares their sync time per step "
                        "(e.g. process,local)")
    p.add_argument("--free-kv", action="store_true",
                   help="sleep(1)/wake_up the engine's KV cache around every push (colocated memory "
                        "saving; the built-in engine then recaptures its CUDA graphs after each sync)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--task", default="long_tail_copy")
    p.add_argument("--batch-prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-response-tokens", type=int, default=100)
    p.add_argument("--task-max-len", type=int, default=96, help="longest answer of the long-tail task")
    p.add_argument("--tail-alpha", type=float, default=0.8, help="Pareto shape of answer lengths")
    p.add_argument("--staleness-threshold", type=float, default=2.0)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--policies", default="sync,one_step_off,fully_async,fully_async_k2")
    p.add_argument("--warmup-steps", type=int, default=3, help="trainer steps each run takes untimed before the timed --steps (0: none)")
    p.add_argument("--output-dir", default="/tmp/asyncrl-bench-runs")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = p.parse_args(argv)
    result: dict[str, Any] = {
        "bench": "async_vs_sync", "device": args.device, "placement": args.placement,
        "runtime": args.runtime, "free_kv": args.free_kv,
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(), "load_average_start": os.getloadavg(),
        "task": args.task, "steps": args.steps, "seeds": args.seeds,
        "batch_size": args.batch_prompts * args.n, "max_response_tokens": args.max_response_tokens,
        "task_max_len": args.task_max_len, "tail_alpha": args.tail_alpha,
        "staleness_threshold": args.staleness_threshold, "max_staleness": args.max_staleness,
        "overrides": args.overrides,
        "policies": {},
    }
    policies = args.policies.split(",")
    runtimes = args.runtime.split(",")
    for rt in runtimes:
        if rt not in ("process", "ray", "local"):
            p.error(f"--runtime: {rt!r} is not one of process, ray, local")
    every: dict[str, dict[str, list[dict[str, Any]]]] = {rt: {policy: [] for policy in policies} for rt in runtimes}
    for seed in range(args.seeds):  # seed-major: a drift in the machine's load hits every policy alike
        for policy in policies:
            for rt in runtimes:
                every[rt][policy].append(_one(policy, seed, rt, args))
                print(f"[async_vs_sync] seed {seed} {policy} {rt}: {every[rt][policy][-1]['wall_s']:.2f} s",
                      file=sys.stderr)
                if args.out:  # every finished run is kept, should the invocation be cut short
                    pathlib.Path(args.out).write_text(json.dumps({**result, "partial": True, "runs_so_far": every},
                                                                 indent=1))
    runs = every[runtimes[0]]
    result["policies"] = {policy: _summarise(r) for policy, r in runs.items()}
    pol = result["policies"]
    for name in pol:
        if name != "sync" and "sync" in pol:
            result[f"speedup_{name}_over_sync"] = pol["sync"]["wall_s"]["mean"] / pol[name]["wall_s"]["mean"]
            result[f"speedup_{name}_over_sync_per_seed"] = [
                round(a["wall_s"] / b["wall_s"], 3) for a, b in zip(runs["sync"], runs[name])]
    if len(runtimes) > 1:  # the same policies under the other runtimes, and their sync cost against the first's
        result["other_runtimes"] = {rt: {policy: _summarise(r) for policy, r in every[rt].items()}
                                    for rt in runtimes[1:]}
        for rt in runtimes[1:]:
            result[f"sync_ms_ratio_{runtimes[0]}_over_{rt}"] = {
                policy: [round(a["sync_ms_mean"] / b["sync_ms_mean"], 3) if b["sync_ms_mean"] else None
                         for a, b in zip(runs[policy], every[rt][policy])]
                for policy in policies}
    result["load_average_end"] = os.getloadavg()
    text = json.dumps(result)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
