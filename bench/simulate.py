"""``python -m bench.simulate``: a calibrated throughput model of the schedules.

    --validate            one JSON object: each kept run not used for calibration,
                          predicted vs measured trained tokens/s per schedule
    --model 0.5b,7b --gpus 8,32,128
                          one JSON object: predictions per schedule at those sizes,
                          the best rollout/trainer split, the inputs assumed

The model itself (events, schedules, admission, in-flight modes) is
``bench.simulate_model``; this file turns kept measurements (``bench/results/``)
into its inputs. Calibration, per setup (machine, model, task, runtime): the kept
``bench.async_vs_sync`` run with the newest code gives the per-step costs from its
sync policy's timings (train step, push, rollout busy time, engine prefill counters,
evaluations; the rest of the step is driver overhead), and from its fully-async policy
the one constant of a shared device (how much slower rollout and trainer run while
both are busy) and what an evaluation costs beside a running rollout. Every older run
of that setup is validated against those inputs, with only its configuration (batch,
group size, lengths cap, staleness, push overlap, evaluations in the window or not)
and its workload (mean response length; the tail exponent is the task's) taken from
it; a configuration change that a standalone bench measured (micro-batch tokens)
scales the input by that bench's ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from bench import simulate_scaling
from bench.simulate_model import Inputs, LengthDist, Schedule, simulate

RESULTS = Path(__file__).resolve().parent / "results"
SEED = 0
NUM_SEEDS = 3  # simulation seeds averaged per prediction (the lengths are random)

# Relative decode cost per running sequence (per-seq / base) for the Qwen2.5-0.5B shape on one
# H200, from engine_h200.json: the step is 0.875 ms at 64 rows (engine_h200_final_b64.json) and
# 1.504 ms at 256 rows, so 0.665 ms + 3.28 µs per row. The 397k built-in model is launch-bound (0).
_H200_05B_STEP_S = (0.875e-3, 64, 1.5043e-3, 256)


def _per_seq_ratio() -> float:
    s64, b64, s256, b256 = _H200_05B_STEP_S
    per_seq = (s256 - s64) / (b256 - b64)
    return per_seq / (s64 - per_seq * b64)


# ---------------------------------------------------------------------------------------------
# Reading kept runs
# ---------------------------------------------------------------------------------------------

def _load(name: str) -> dict[str, Any]:
    d = json.loads((RESULTS / name).read_text())
    if name == "h200_trainer_and_length_probe.json":
        d = {**d["untrained_16_token_responses"], "command": d["untrained_16_token_responses"]["command"]}
    r = d.get("result", d)
    r.setdefault("command", d.get("command", ""))
    return r


def _mean(p: dict[str, Any], key: str) -> float | None:
    v = p.get(key)
    if isinstance(v, dict):
        return v.get("mean")
    if v is None and p.get("seeds"):
        vals = [s[key] for s in p["seeds"] if isinstance(s.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None
    return v


def _seed_mean(p: dict[str, Any], path: tuple[str, ...]) -> float | None:
    vals = []
    for s in p.get("seeds", []):
        x: Any = s
        for k in path:
            x = x.get(k) if isinstance(x, dict) else None
        if isinstance(x, (int, float)):
            vals.append(float(x))
    return sum(vals) / len(vals) if vals else None


def _group_size(run: dict[str, Any]) -> int:
    """Samples a prompt (``--n``): the run's batch over its prompts (``--batch-prompts``, default 8)."""
    argv = shlex.split(run.get("command") or "")
    prompts = int(argv[argv.index("--batch-prompts") + 1]) if "--batch-prompts" in argv else 8
    return int(run["batch_size"]) // prompts


def _prompt_len(run: dict[str, Any]) -> int:
    # Prompt tokens per sample (prefill and trained tokens): text_arithmetic's prompts are ~30 tokens
    # (the trainer_step A/B in async_vs_sync_h200_text_v5_tail_mb16k.json uses --prompt-len 30);
    # long_tail_copy's prompt is the string to copy (its mean length) plus a separator.
    return 30 if run["task"] == "text_arithmetic" else 14


def _tail(run: dict[str, Any]) -> float:
    """The response-length tail exponent of the run's task (inf: fixed length)."""
    kw = run.get("task_kwargs") or {}
    if "16_token" in (run.get("command") or "") or "random init" in (run.get("command") or ""):
        return math.inf
    if "tail_alpha" in kw:
        return float(kw["tail_alpha"])
    if "tail_alpha" in run:
        return float(run["tail_alpha"])
    return 8.0  # text_arithmetic without a tail: 2-digit sums, answers of nearly one length


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per-step costs of one setup, from one kept run (see the module docstring)."""

    source: str
    decode_base_s: float
    decode_per_seq_s: float
    prefill_per_token_s: float
    train_s: float
    push_s: float
    push_paused_s: float
    push_encode_s: float
    overhead_s: float  # per step, evaluations excluded
    eval_per_step_s: float  # what the in-loop evaluations cost, per step (0 when none)
    eval_overlapped_per_step_s: float = 0.0  # the same under a schedule whose rollout runs beside them
    contention: float = 1.0

    def inputs(self, run: dict[str, Any], policy: str, train_scale: float = 1.0) -> Inputs:
        p = run["policies"][policy]
        rlen = _mean(p, "response_len_mean") or _seed_mean(p, ("response_len_mean",))
        cap = int(run["max_response_tokens"])
        alpha = _tail(run)
        lengths = LengthDist.fixed(round(rlen)) if math.isinf(alpha) else LengthDist.with_mean(rlen, alpha, cap)
        evals = bool(run.get("eval_every")) and bool(run.get("eval_prompts"))
        return Inputs(decode_base_s=self.decode_base_s, decode_per_seq_s=self.decode_per_seq_s,
                      prefill_per_token_s=self.prefill_per_token_s, train_fixed_s=self.train_s * train_scale,
                      train_per_token_s=0.0, push_s=self.push_s, push_paused_s=self.push_paused_s,
                      push_encode_s=self.push_encode_s, lengths=lengths, prompt_len=_prompt_len(run),
                      samples_per_step=int(run["batch_size"]), group_size=_group_size(run),
                      step_overhead_s=self.overhead_s, colocated=True, contention=self.contention,
                      eval_per_step_s=(0.0 if not evals else self.eval_per_step_s if policy == "sync"
                                       else self.eval_overlapped_per_step_s or self.eval_per_step_s),
                      eval_in_wall=bool(run.get("eval_in_window")))


def schedule_of(run: dict[str, Any], policy: str, overlap_push: bool = False) -> Schedule:
    s, k = float(run.get("staleness_threshold", 1.0)), int(run.get("max_staleness", 2))
    if policy in ("sync", "one_step_off"):
        return Schedule(policy)
    every = 2 if policy == "fully_async_k2" else 1
    return Schedule("fully_async", staleness_threshold=s, max_staleness=k, sync_every=every,
                    in_flight="abort", overlap_push=overlap_push)


def predict(inp: Inputs, sched: Schedule, steps: int, warmup: int = 2) -> float:
    rates = [simulate(inp, sched, num_steps=steps, seed=SEED + i, warmup_steps=warmup).trained_tokens_per_s
             for i in range(NUM_SEEDS)]
    return sum(rates) / len(rates)


def calibrate(name: str, per_seq_ratio: float, fit_contention: bool = True,
              prefill_per_token_s: float | None = None) -> Calibration:
    """Per-step costs from a kept run's sync policy; the shared-device constant from its fully-async.
    ``prefill_per_token_s``: used when the run has no engine prefill counters."""
    run = _load(name)
    p = run["policies"]["sync"]
    steps = int(run["steps"])
    step_s = _mean(p, "wall_s") / steps
    train_ms = _mean(p, "train_step_ms_mean")
    train_s = train_ms / 1e3 if train_ms else (1.0 - _mean(p, "trainer_idle_ratio")) * step_s
    gen_s = (1.0 - _mean(p, "rollout_idle_ratio")) * step_s
    push_s = _mean(p, "sync_ms_mean") / 1e3
    paused = _seed_mean(p, ("sync_parts_ms_mean", "paused"))
    encode = _seed_mean(p, ("sync_parts_ms_mean", "encode"))
    push_paused_s = paused / 1e3 if paused else push_s / 2
    push_encode_s = encode / 1e3 if encode else push_s / 2
    eval_s = _mean(p, "eval_s") or 0.0  # the in-loop evaluations (in wall_s only with eval_in_window)
    in_wall_eval_s = eval_s if run.get("eval_in_window") else 0.0
    overhead_s = max(0.0, step_s - gen_s - train_s - push_s - in_wall_eval_s / steps)
    prefill_s, prefill_seqs = _seed_mean(p, ("engine", "prefill_s")), _seed_mean(p, ("engine", "num_prefill_seqs"))
    prompt = _prompt_len(run)
    b = int(run["batch_size"])
    if prefill_s and prefill_seqs:
        per_seq = prefill_s / prefill_seqs
    elif prefill_per_token_s is not None:  # a run without the counters: the setup's rate
        per_seq = prefill_per_token_s * prompt
    else:
        raise ValueError(f"{name}: a calibration run must record the engine's prefill_s and num_prefill_seqs")
    prefill_per_token_s = per_seq / prompt
    # Decode: the rest of the rollout's busy time, spread over the decode steps of one simulated batch.
    probe = Calibration(name, 1.0, per_seq_ratio, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    unit = dataclasses.replace(probe.inputs(run, "sync"), train_fixed_s=0.0, step_overhead_s=0.0, colocated=False)
    units = sum(simulate(unit, Schedule("sync"), num_steps=20, seed=SEED + i).steps_per_s ** -1
                for i in range(NUM_SEEDS)) / NUM_SEEDS
    decode_base_s = max(0.0, gen_s - per_seq * b) / units
    cal = Calibration(name, decode_base_s, decode_base_s * per_seq_ratio, prefill_per_token_s, train_s, push_s,
                      push_paused_s, push_encode_s, overhead_s, eval_s / steps)
    if "fully_async" not in run["policies"]:
        return cal
    # An evaluation shares the engine with fully-async's in-flight rollout: its own time, measured.
    eval_async_s = _mean(run["policies"]["fully_async"], "eval_s") or 0.0
    cal = dataclasses.replace(cal, eval_overlapped_per_step_s=eval_async_s / steps)
    if not fit_contention:
        return cal
    measured = _mean(run["policies"]["fully_async"], "tokens_per_s")
    sched = schedule_of(run, "fully_async")

    def pred(c: float) -> float:
        return predict(dataclasses.replace(cal, contention=c).inputs(run, "fully_async"), sched, steps)

    lo, hi = 1.0, 4.0
    if pred(lo) <= measured:
        return cal
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pred(mid) > measured else (lo, mid)
    return dataclasses.replace(cal, contention=round((lo + hi) / 2, 3))


# Which run calibrates which: setup -> (calibration run, [(validation run, what differs)]).
# The rule: the newest code of a setup calibrates (it is the code the model describes); the
# older runs of that setup validate. Code order from each file's README row / git log.
SETUPS: dict[str, dict[str, Any]] = {
    "h200_402m_text_process": {
        "machine": "one NVIDIA H200 (lent), process runtime, colocated, 402M bf16, text_arithmetic",
        "per_seq_ratio": "qwen05b",
        "calibrate": "async_vs_sync_h200_text_v6_fair.json",
        "validate": [
            ("async_vs_sync_h200_text_v5_tail_mb16k.json", {}),
            ("async_vs_sync_h200_text_v4_tail.json", {"train_scale": "mb2048"}),
            ("h200_trainer_and_length_probe.json", {"train_scale": "mb2048"}),
            ("async_vs_sync_h200_text_v3.json", {"train_scale": "mb2048"}),
        ],
    },
    "h200_397k_copy_process": {
        "machine": "one NVIDIA H200 (lent), process runtime, colocated, 397k built-in, long_tail_copy",
        "per_seq_ratio": "none",
        "calibrate": "async_vs_sync_h200_process.json",
        "validate": [("async_vs_sync_h200_process_overlap.json", {"overlap_push": True})],
    },
    "h200_397k_copy_local": {
        "machine": "one NVIDIA H200 (lent), local runtime (one process), colocated, 397k built-in, long_tail_copy",
        "per_seq_ratio": "none",
        "calibrate": "async_vs_sync_h200.json",
        "validate": [("async_vs_sync_h200_diag.json", {})],
    },
    "cpu_397k_copy_process": {
        "machine": "2-core x86_64 VM (shared), process runtime, colocated, 397k built-in, long_tail_copy",
        "per_seq_ratio": "none",
        "calibrate": "async_vs_sync_cpu_workers.json",
        "validate": [("async_vs_sync_cpu_direct.json", {}), ("async_vs_sync_cpu.json", {})],
    },
}

LEFT_OUT = {
    "async_vs_sync_cpu_ray.json": "Ray runtime: its per-call overheads are in no process- or local-runtime run "
                                  "and no standalone bench, and it is the only kept Ray-runtime run",
    "async_vs_sync_h200_free_kv.json": "free_kv: the engine frees and re-allocates its KV cache at every push, "
                                       "a cost no kept bench measures",
    "async_vs_sync_h200_direct.json": "358M random weights on long_tail_copy: response lengths 10-100 by seed "
                                      "(a property of the random weights), and no other run of that model on that task",
    "async_vs_sync_h200_text.json": "partial (5 of 6 runs)",
    "async_vs_sync_h200_text_plan_rebuilt.json": "its code rebuilt the weight-sync plan at every push "
                                                 "(~100 ms, fixed in 12722df): that cost is recorded only in this run",
    "async_vs_sync_h200_smollm2_fair.json": "the only run of SmolLM2-135M: no standalone trainer or engine bench "
                                            "of that model, and no second run to calibrate on",
}


def _train_scale(kind: str | None) -> tuple[float, str | None]:
    if kind != "mb2048":
        return 1.0, None
    ab = json.loads((RESULTS / "async_vs_sync_h200_text_v5_tail_mb16k.json").read_text())["trainer_step_ab"]
    ms = {k: sum(v["backends"]["torch"]["step_ms"]) / len(v["backends"]["torch"]["step_ms"])
          for k, v in ab.items() if k in ("2048", "16384")}
    ratio = ms["2048"] / ms["16384"]
    return ratio, (f"trainer step x{ratio:.3f}: micro_batch_tokens 2048 (the default then) vs 16384, "
                   f"bench.trainer_step A/B kept in async_vs_sync_h200_text_v5_tail_mb16k.json")


def _fit(cal: Calibration, run: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The calibration run's policies predicted from its own calibration (in-sample)."""
    return {pol: {"predicted_tokens_per_s": round(predict(cal.inputs(run, pol), schedule_of(run, pol),
                                                          int(run["steps"])), 1),
                  "measured_tokens_per_s": round(_mean(run["policies"][pol], "tokens_per_s"), 1)}
            for pol in run["policies"]}


def validate() -> dict[str, Any]:
    ratios = {"qwen05b": _per_seq_ratio(), "none": 0.0}
    out: dict[str, Any] = {
        "bench": "simulate --validate",
        "machine": _machine(),
        "method": __doc__.split("\n\n")[2].replace("\n", " ").strip(),
        "setups": {}, "left_out": LEFT_OUT, "runs": [],
    }
    errors = []
    for setup, spec in SETUPS.items():
        cal = calibrate(spec["calibrate"], ratios[spec["per_seq_ratio"]])
        out["setups"][setup] = {"machine": spec["machine"], "calibrated_on": spec["calibrate"],
                                "inputs": {k: (round(v, 7) if isinstance(v, float) else v)
                                           for k, v in dataclasses.asdict(cal).items()},
                                "fit_on_calibration_run": _fit(cal, _load(spec["calibrate"]))}
        for name, how in spec["validate"]:
            run = _load(name)
            scale, why = _train_scale(how.get("train_scale"))
            row: dict[str, Any] = {"run": name, "setup": setup, "calibrated_on": spec["calibrate"],
                                   "steps": run["steps"], "batch_size": run["batch_size"], "policies": {}}
            if why:
                row["adjusted"] = why
            if how.get("overlap_push"):
                row["adjusted"] = "push overlapped with the next train step (policy.overlap_push=true in that code)"
            for policy in run["policies"]:
                inp = cal.inputs(run, policy, train_scale=scale)
                sched = schedule_of(run, policy, overlap_push=bool(how.get("overlap_push")))
                pred = predict(inp, sched, int(run["steps"]))
                meas = _mean(run["policies"][policy], "tokens_per_s")
                err = (pred - meas) / meas
                errors.append(abs(err))
                row["policies"][policy] = {"predicted_tokens_per_s": round(pred, 1),
                                           "measured_tokens_per_s": round(meas, 1),
                                           "relative_error": round(err, 3)}
            if len(run["policies"]) > 1:
                own = dataclasses.replace(calibrate(name, ratios[spec["per_seq_ratio"]], fit_contention=False,
                                                    prefill_per_token_s=cal.prefill_per_token_s),
                                          contention=cal.contention)
                row["schedule_check"] = {
                    "what": "not a validation: this run's own sync-policy costs (and the setup's shared-device "
                            "constant) predicting its other schedules; separates the schedule model from drift of "
                            "the per-step costs between code versions and machine loads",
                    **{pol: round((predict(own.inputs(run, pol), schedule_of(run, pol, bool(how.get("overlap_push"))),
                                           int(run["steps"])) - _mean(run["policies"][pol], "tokens_per_s"))
                                  / _mean(run["policies"][pol], "tokens_per_s"), 3)
                       for pol in run["policies"] if pol != "sync"}}
            out["runs"].append(row)
    out["max_abs_relative_error"] = round(max(errors), 3)
    out["within_20_percent"] = sum(e <= 0.2 for e in errors)
    out["predictions"] = len(errors)
    out["all_within_20_percent"] = out["within_20_percent"] == len(errors)
    return out


def _machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return (f"{platform.machine()} VM, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"load {tuple(round(x, 2) for x in load) if load else 'n/a'} (the simulation itself; no GPU)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--validate", action="store_true", help="predicted vs measured on kept runs not calibrated on")
    ap.add_argument("--model", default="0.5b,7b", help="model sizes for scaling predictions: 0.5b, 7b")
    ap.add_argument("--gpus", default="8,32,128", help="total GPU counts, comma-separated")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.validate:
        result = validate()
    else:
        models = [m.strip().lower() for m in args.model.split(",") if m.strip()]
        try:
            gpus = [int(g) for g in args.gpus.split(",") if g]
            result = simulate_scaling.scaling(models, gpus, _machine())
        except ValueError as e:
            ap.error(str(e))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
