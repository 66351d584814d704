"""Time to quality: how soon each policy reaches a held-out reward, from launch.

    python -m bench.time_to_quality                      # CPU: the default job's model and task, smoke size
    python -m bench.time_to_quality --config examples/smollm2_gpu.yaml --seeds 5 \\
        --out ttq.json --png ttq.png                     # one GPU, SmolLM2-135M-Instruct (README "On a GPU")
    python -m bench.time_to_quality --merge a.json b.json --out all.json --png all.png

Every policy runs the same config, seeds, task, held-out prompts and number of
steps; nothing differs but the policy's own overrides (``POLICIES``, or
``--variant NAME=OVERRIDES`` for another setting of one). Seeds run one after
the other, every policy in each (seed-major), the order rotating from seed to
seed (``bench.async_vs_sync.rotated``) so no policy always runs first.

Each run is timed from launch: the clock starts before the config is read and
stops at its last step, so startup (actors, model load, the engine's first
graphs) counts, and so do the held-out evaluations (``policy.eval_every``,
greedy, ``policy.eval_prompts`` prompts, at step 0 and every K steps). What a
process or machine pays once (imports, on-disk kernel caches) is paid before
the first timed run (``preload``, the throw-away run). An evaluation runs
beside training: fully-async trains on meanwhile, the baselines wait for it at
their next push, as in ``bench.async_vs_sync``; nobody gets generation while
the clock is stopped. A point of the curve is the reward of the weights of
step s, at the time step s ended.

Per evaluation the JSON keeps the step, the trained samples, the seconds since
launch and since the first step began (startup excluded), the reward and the
mean response length. Per policy: the mean reward at each evaluation with a
95% bootstrap interval over seeds; the target (90% of sync's mean reward at
its last evaluation; the first policy's when sync does not run); each seed's
time to the target (the first crossing, linearly interpolated between two
evaluations; null when never reached), from launch and from the first step,
their medians and the ratio of each policy's median over sync's; the reward at
equal wall time (each seed's curve interpolated at four times up to the
earliest last evaluation of any run). ``goals`` states, for every policy
against sync: (a) its mean inside sync's interval or above at every
evaluation, (b) its median time to target from launch at most half of sync's.

A GPU lease runs some seeds per call: ``--first-seed`` picks where a call
starts, and ``--merge`` pools the runs of several JSONs made with the same
settings (it refuses others; a policy must have the same overrides in each)
and writes the summary and the plot again. Per step a run also keeps what
reached the trainer (``steps``: the batch's reward, response length,
staleness, the share of its groups with one reward for every sample,
which give no gradient, and the loss's ``kl_behav`` and ``clip_frac``: how far
the sampler's log-probs sat from the trainer's; ``behav_capped_frac`` and
``dual_clip_frac`` where the loss caps or dual-clips), to see which samples a
policy learns from. Each run names its row's columns in ``steps_fields``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import random
import statistics
import sys
import time
from typing import Any

from actors.launch import launch
from bench.async_vs_sync import POLICIES, rotated

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Runs are built from YAML overrides: a process runtime's children need nothing defined here.
SPAWN_IMPORTS_MAIN = False
TARGET_SHARE = 0.9  # the target is this share of sync's final mean held-out reward
BOOTSTRAP_RESAMPLES = 2000
EQUAL_TIME_POINTS = 4


def run_once(name: str, overrides: list[str], seed: int, args: argparse.Namespace, *,
             steps: int | None = None, eval_every: int | None = None) -> dict[str, Any]:
    """One run of ``name`` from launch to its last step: its evaluations, clocks and throughput."""
    steps = args.steps if steps is None else steps
    eval_every = args.eval_every if eval_every is None else eval_every
    t0 = time.perf_counter()
    run = launch(args.config, f"run.seed={seed}", f"run.total_steps={steps}", "run.progress=false",
                 f"run.output_dir={args.output_dir}", f"policy.eval_every={eval_every}",
                 f"policy.eval_prompts={args.eval_prompts}", *args.overrides, *overrides)
    with run:
        t_train = time.perf_counter()
        hist = run.train(steps)
        t_end = time.perf_counter()
        policy_start = run.policy.started_at - t0  # the records' elapsed_s count from here
        initial = run.initial_eval
        startup = dict(run.startup)
    first_step_at = t_train - t0

    def point(record: dict[str, Any], at: float) -> dict[str, Any]:
        return {"step": record["step"], "trained": record["eval/at_trained"], "since_launch_s": round(at, 3),
                "since_first_step_s": round(at - first_step_at, 3), "reward": record["eval/reward"],
                "response_len": record["eval/response_len_mean"]}

    evals = [point(initial, first_step_at)] if initial and "eval/reward" in initial else []
    evals += [point(m, policy_start + m["elapsed_s"]) for m in hist if "eval/reward" in m]
    train_s = t_end - t_train
    return {
        "policy": name, "seed": seed, "overrides": overrides,
        "wall_s": round(t_end - t0, 3), "startup_s": round(startup.get("total_s", 0.0), 3),
        "train_s": round(train_s, 3), "steps_per_s": len(hist) / train_s,
        "trained_tokens_per_s": sum(m["num_tokens"] for m in hist) / train_s,
        "eval_s": round(sum(m.get("eval/s", 0.0) for m in [initial or {}, *hist]), 3),
        "evals": evals,
        # what reached the trainer, step by step: the batch's reward, response length and staleness,
        # and how far the sampler sat from the trainer (None where the loss does not report it)
        "steps": [[m["step"], round(policy_start + m["elapsed_s"], 3), round(m["reward"], 4),
                   round(m["response_len_mean"], 1), round(m["staleness_mean"], 3),
                   round(m.get("zero_adv_group_share", -1.0), 3),
                   *(_rounded(m.get(f"train/{k}")) for k in _LOSS_COLUMNS)] for m in hist],
        "steps_fields": ["step", "since_launch_s", "batch_reward", "response_len_mean", "staleness_mean",
                         "zero_adv_group_share", *_LOSS_COLUMNS],
        "dropped": hist[-1]["dropped"] if hist else {},
    }


#: The loss's metrics a step row keeps (None where the loss does not report one): how far the sampler
#: sat from the trainer, and how many tokens each of its clips or caps held.
_LOSS_COLUMNS = ("kl_behav", "clip_frac", "behav_capped_frac", "dual_clip_frac")


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


def preload(args: argparse.Namespace) -> None:
    """Read every policy's config once, untimed: what a process imports to read one
    (transformers; Liger's and Triton's modules when ``trainer.kernels`` resolves to
    liger: ~5 s on an H100 host) is paid once per process, and would otherwise land
    in whichever run a call times first."""
    import actors.models  # noqa: F401  transformers: resolving a model path imports it
    from actors.config import load_config

    for name in args.names:
        load_config(args.config, [*args.overrides, *(POLICIES.get(name) or args.variants[name])])


# ----------------------------------------------------------------- statistics


def bootstrap_ci(values: list[float], *, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> list[float]:
    """95% percentile bootstrap interval of the mean of ``values`` (resampled with
    replacement, a fixed RNG so a summary is reproducible); one value: [v, v]."""
    if len(values) < 2:
        return [values[0], values[0]] if values else [math.nan, math.nan]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [means[int(0.025 * (resamples - 1))], means[int(math.ceil(0.975 * (resamples - 1)))]]


def first_crossing(points: list[tuple[float, float]], target: float) -> float | None:
    """The first x where the piecewise-linear curve through ``points`` (x, reward)
    reaches ``target``; None if it never does."""
    if points and points[0][1] >= target:
        return points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 >= target > y0:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return None


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """The piecewise-linear curve through ``points`` at ``x`` (held flat past its ends)."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


def median_or_none(values: list[float | None]) -> float | None:
    """Median with a never-reached (None) counted as infinitely late: None when
    half or more of the seeds never reached it."""
    ordered = sorted(math.inf if v is None else v for v in values)
    if not ordered:
        return None
    m = statistics.median(ordered)
    return None if math.isinf(m) else m


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The per-policy curves, the time to target and the goals of the module docstring."""
    names = list(runs)
    base = "sync" if "sync" in runs else names[0]
    final = [r["evals"][-1]["reward"] for r in runs[base]]
    target = TARGET_SHARE * statistics.fmean(final)
    last_times = [r["evals"][-1]["since_launch_s"] for rs in runs.values() for r in rs]
    grid = [round(min(last_times) * (k + 1) / EQUAL_TIME_POINTS, 3) for k in range(EQUAL_TIME_POINTS)]
    out: dict[str, Any] = {"target": round(target, 4), "target_from": f"{TARGET_SHARE} x {base}'s final mean",
                           "baseline": base, "equal_time_grid_s": grid, "policies": {}}
    for name, rs in runs.items():
        steps = sorted({e["step"] for r in rs for e in r["evals"]})
        curve = []
        for step in steps:
            at = [(e["reward"], e["since_launch_s"], e["trained"]) for r in rs for e in r["evals"] if e["step"] == step]
            rewards = [a[0] for a in at]
            curve.append({"step": step, "trained": at[0][2], "num_seeds": len(at),
                          "since_launch_s_mean": round(statistics.fmean(a[1] for a in at), 3),
                          "reward_mean": round(statistics.fmean(rewards), 4),
                          "reward_ci95": [round(v, 4) for v in bootstrap_ci(rewards, seed=step)]})
        ttt = {clock: [first_crossing([(e[f"since_{clock}_s"], e["reward"]) for e in r["evals"]], target)
                       for r in rs] for clock in ("launch", "first_step")}
        at_time = [[interpolate([(e["since_launch_s"], e["reward"]) for e in r["evals"]], t) for r in rs] for t in grid]
        out["policies"][name] = {
            "seeds": [r["seed"] for r in rs],
            "curve": curve,
            "time_to_target_s": {clock: [None if v is None else round(v, 3) for v in vals]
                                 for clock, vals in ttt.items()},
            "median_time_to_target_s": {clock: median_or_none(vals) for clock, vals in ttt.items()},
            "reached_target": sum(v is not None for v in ttt["launch"]),
            "reward_at_equal_time": [{"since_launch_s": t, "mean": round(statistics.fmean(v), 4),
                                      "ci95": [round(x, 4) for x in bootstrap_ci(v, seed=i)]}
                                     for i, (t, v) in enumerate(zip(grid, at_time))],
            **{f"{k}_mean": round(statistics.fmean(r[k] for r in rs), 4)
               for k in ("wall_s", "startup_s", "train_s", "steps_per_s", "trained_tokens_per_s", "eval_s")},
            "final_reward_mean": round(statistics.fmean(r["evals"][-1]["reward"] for r in rs), 4),
            "final_reward_ci95": [round(v, 4) for v in bootstrap_ci([r["evals"][-1]["reward"] for r in rs])],
        }
    ref = out["policies"][base]
    for name in names:
        if name == base:
            continue
        mine = out["policies"][name]
        ratio = {clock: (None if mine["median_time_to_target_s"][clock] is None
                         or not ref["median_time_to_target_s"][clock] else
                         round(mine["median_time_to_target_s"][clock] / ref["median_time_to_target_s"][clock], 4))
                 for clock in ("launch", "first_step")}
        low = {c["step"]: c["reward_ci95"][0] for c in ref["curve"]}
        misses = [c["step"] for c in mine["curve"] if c["step"] in low and c["reward_mean"] < low[c["step"]]]
        mine[f"median_time_to_target_over_{base}"] = ratio
        mine[f"steps_per_s_over_{base}"] = round(mine["steps_per_s_mean"] / ref["steps_per_s_mean"], 4)
        mine[f"trained_tokens_per_s_over_{base}"] = round(
            mine["trained_tokens_per_s_mean"] / ref["trained_tokens_per_s_mean"], 4)
        mine["goals"] = {
            f"a_inside_or_above_{base}_interval_at_every_eval": not misses, "a_steps_below": misses,
            f"b_time_to_target_from_launch_at_most_half_of_{base}": ratio["launch"] is not None
            and ratio["launch"] <= 0.5,
        }
    return out


# ----------------------------------------------------------------------- plot


def plot(result: dict[str, Any], path: str | pathlib.Path) -> None:
    """Reward against wall time since launch (left) and against steps (right):
    a thin line per seed, the mean over seeds with its 95% band, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, rs) in enumerate(result["runs"].items()):
        color = f"C{i}"
        curve = result["summary"]["policies"][name]["curve"]
        for r in rs:
            left.plot([e["since_launch_s"] for e in r["evals"]], [e["reward"] for e in r["evals"]],
                      color=color, lw=0.6, alpha=0.35)
            right.plot([e["step"] for e in r["evals"]], [e["reward"] for e in r["evals"]], color=color, lw=0.6,
                       alpha=0.35)
        for ax, x in ((left, [c["since_launch_s_mean"] for c in curve]), (right, [c["step"] for c in curve])):
            ax.plot(x, [c["reward_mean"] for c in curve], color=color, lw=2, label=f"{name} ({len(rs)} seeds)")
            ax.fill_between(x, [c["reward_ci95"][0] for c in curve], [c["reward_ci95"][1] for c in curve],
                            color=color, alpha=0.18, lw=0)
    target = result["summary"]["target"]
    for ax, xlabel in ((left, "seconds since launch (startup and evaluations included)"), (right, "trainer step")):
        ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out reward (greedy)")
        ax.grid(alpha=0.3)
    left.legend(loc="lower right", fontsize=8)
    fig.suptitle(result.get("title", "time to quality"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------ CLI


def _variant(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest.strip() or name in POLICIES:
        raise argparse.ArgumentTypeError(
            f"expected NAME=key.path=value [key.path=value ...] with a new NAME, got {text!r}")
    return name, rest.split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "fully_async.yaml"),
                   help="the config every run starts from (default: fully_async.yaml, the CPU default job)")
    p.add_argument("--policies", default=None,
                   help=f"comma list of {', '.join(POLICIES)} and --variant names (default sync,fully_async); "
                        "with --merge, the policies to keep (default: all)")
    p.add_argument("--variant", action="append", type=_variant, default=[], metavar="NAME=OVERRIDES",
                   help="another policy to run: a name and its space-separated overrides, e.g. "
                        "'fa_s4=policy.type=fully_async policy.staleness_threshold=4'")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--no-warmup-run", dest="warmup_run", action="store_false",
                   help="skip the throw-away run (2 steps of the first policy, a seed no timed run uses) "
                        "that takes what a process or machine pays once out of the first timed run")
    p.add_argument("--output-dir", default="/tmp/asyncrl-ttq-runs")
    p.add_argument("--out", default=None, help="write the JSON here too (after every run, should a call be cut)")
    p.add_argument("--png", default=None, help="write the plot here")
    p.add_argument("--title", default=None)
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="pool the runs of these results (same settings) instead of running")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="for every policy")
    args = p.parse_args(argv)
    if args.merge:
        return args
    args.variants = dict(args.variant)
    names = (args.policies or "sync,fully_async").split(",")
    unknown = [n for n in names if n not in POLICIES and n not in args.variants]
    if unknown:
        p.error(f"--policies: unknown {', '.join(map(repr, unknown))} (known: {', '.join([*POLICIES, *args.variants])})")
    if min(args.seeds, args.steps, args.eval_every, args.eval_prompts) < 1 or args.first_seed < 0:
        p.error("--seeds, --steps, --eval-every, --eval-prompts must be >= 1 and --first-seed >= 0")
    if args.steps % args.eval_every:
        p.error(f"--steps {args.steps} must be a multiple of --eval-every {args.eval_every} "
                "(every run ends on an evaluation)")
    if not pathlib.Path(args.config).is_file():
        p.error(f"--config: no such file {args.config}")
    args.names = names
    return args


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What every policy shares: a merge pools only results whose settings are equal."""
    return {"config": os.path.relpath(args.config, ROOT), "steps": args.steps, "eval_every": args.eval_every,
            "eval_prompts": args.eval_prompts, "overrides": args.overrides,
            "policies": {n: POLICIES.get(n) or args.variants[n] for n in args.names}}


def merge(paths: list[str], keep: list[str] | None = None) -> dict[str, Any]:
    parts = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    first = parts[0]
    shared = {k: v for k, v in first["settings"].items() if k != "policies"}
    policies: dict[str, list[str]] = {}
    for path, part in zip(paths, parts):
        if {k: v for k, v in part["settings"].items() if k != "policies"} != shared:
            raise SystemExit(f"--merge: {path} was made with other settings than {paths[0]}")
        for name, overrides in part["settings"]["policies"].items():
            if policies.setdefault(name, overrides) != overrides:
                raise SystemExit(f"--merge: policy {name} has other overrides in {path}")
    if keep:
        if unknown := [n for n in keep if n not in policies]:
            raise SystemExit(f"--policies: {', '.join(unknown)} not in the merged results ({', '.join(policies)})")
        policies = {n: policies[n] for n in keep}
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in policies}
    for part in parts:
        for name, rs in part["runs"].items():
            if name in runs:
                runs[name] += rs
    for name, rs in runs.items():
        seeds = [r["seed"] for r in rs]
        if len(set(seeds)) != len(seeds):
            raise SystemExit(f"--merge: policy {name} has seed(s) {sorted({s for s in seeds if seeds.count(s) > 1})} "
                             "more than once")
        rs.sort(key=lambda r: r["seed"])
    order: dict[str, list[str]] = {}  # each seed's runs in the order they ran, call after call
    for part in parts:
        for seed, names in part["policy_order"].items():
            order.setdefault(seed, []).extend(n for n in names if n in policies)
    drop = ("runs", "summary", "partial", "seeds", "policy_order", "title")  # a title names its own file's policies
    return {**{k: v for k, v in first.items() if k not in drop},
            "settings": {**shared, "policies": policies}, "policy_order": order,
            "merged_from": [os.path.basename(p) for p in paths],
            "machines": sorted({part["machine"] for part in parts}), "runs": runs, "summary": summarise(runs)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        result = merge(args.merge, args.policies.split(",") if args.policies else None)
    else:
        preload(args)
        result = {"bench": "time_to_quality", "settings": settings(args),
                  "machine": f"{platform.node()} {platform.machine()}", "cpu_count": os.cpu_count(),
                  "seeds": list(range(args.first_seed, args.first_seed + args.seeds)), "policy_order": {},
                  "clock": "since_launch_s: from before the config is read to the end of the step whose "
                           "weights were evaluated (startup and every evaluation included); since_first_step_s: "
                           "from the start of the first train call",
                  "runs": {n: [] for n in args.names}}
        policies = result["settings"]["policies"]
        if args.warmup_run:  # a seed no timed run uses; results dropped
            t = time.perf_counter()
            run_once(args.names[0], policies[args.names[0]], 10_000 + args.first_seed, args, steps=2, eval_every=2)
            result["warmup_run_s"] = round(time.perf_counter() - t, 2)
        for seed in result["seeds"]:
            order = rotated(args.names, seed)
            result["policy_order"][str(seed)] = order
            for name in order:
                one = run_once(name, policies[name], seed, args)
                result["runs"][name].append(one)
                print(f"[time_to_quality] seed {seed} {name}: {one['wall_s']:.1f} s from launch, final reward "
                      f"{one['evals'][-1]['reward']:.3f}", file=sys.stderr)
                if args.out:
                    pathlib.Path(args.out).write_text(json.dumps({**result, "partial": True}, indent=1))
        result["summary"] = summarise(result["runs"])
    if args.title:
        result["title"] = args.title
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    if args.png:
        plot(result, args.png)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
