"""``python -m bench.simulate``: a throughput model of the schedules, fed with measured costs.

    --validate            one JSON object: each kept run not used for calibration,
                          predicted vs measured trained tokens/s per schedule
    --model 0.5b,7b --gpus 8,32,128
                          one JSON object: predictions per schedule at those sizes,
                          the best rollout/trainer split, the inputs assumed

The model itself (events, schedules, admission, in-flight modes, evaluations) is
``bench.simulate_model``; this file turns kept measurements (``bench/results/``) into its
inputs. Validation predicts each policy of a kept ``bench.async_vs_sync`` run, seed by
seed, from what its parts cost (each seed's own component clocks: the engine's decode-step
and prefill counters, the trainer's step, the weight syncs), its workload (the mean
response length it trained, under the length law of its model) and its configuration
(batch, group size, response cap, staleness, evaluations, warm-up, push overlap, in-flight
mode). Two per-setup constants cover the time no component clock holds: the rollout's
time per sample outside the engine's counted steps, and the driver's time per step
outside train, sync and evaluations; both come from the sync policy of one calibration
run per setup (machine, model family, task), which is not validated. No run's throughput,
idle or busy ratio, engine tokens/s, decode rows or wall time (but to turn a kept trainer
idle ratio back into the trainer's busy seconds) is an input to its own prediction; the
evaluations' time is predicted, not read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
ENGINE_MAX_NUM_SEQS = 128  # actors/engines/config.py's max_num_seqs: sequences one engine runs at once

# Decode-step growth per running row, relative to the step at no rows, per model shape (outside any
# timed window: standalone engine benches). The counters give one mean step; this splits it.
#   qwen05b: engine_h200_final_b64.json 0.875 ms at 64 rows, engine_h200.json 1.504 ms at 256 rows
#            (the 402M and 358M runs share the Qwen2.5-0.5B body)
#   smollm2: async_vs_sync_h200_smollm2_steps.json `standalone.engine`: 181 decode steps at 64 and at
#            128 rows, counted launch + wait + post seconds
#   none:    the 397k built-in model's step is launch-bound: no growth per row


def _decode_steps_alone(standalone: dict[str, Any]) -> dict[int, float]:
    """A ``standalone`` section's engine: concurrency -> its counted decode step (launch + wait + post)."""
    return {int(k): sum(v["timing_s"][f"decode_{p}_s"] for p in ("launch", "wait", "post"))
            / v["timing_s"]["num_decode_steps"] for k, v in standalone["engine"].items()}


def _line(points: dict[int, float]) -> tuple[float, float]:
    """(step at no rows, growth per row) through the fewest and the most rows measured."""
    (b1, s1), (b2, s2) = sorted(points.items())[0], sorted(points.items())[-1]
    per_row = (s2 - s1) / (b2 - b1)
    return s1 - per_row * b1, per_row


def _per_row_ratio(shape: str) -> float:
    if shape == "none":
        return 0.0
    if shape == "qwen05b":
        base, per_row = _line({64: 0.875e-3, 256: 1.5043e-3})
    else:
        run = json.loads((RESULTS / "async_vs_sync_h200_smollm2_steps.json").read_text())
        base, per_row = _line(_decode_steps_alone(run["standalone"]))
    return per_row / base


# ---------------------------------------------------------------------------------------------
# Reading kept runs
# ---------------------------------------------------------------------------------------------

def _load(name: str, runtime: str | None = None) -> dict[str, Any]:
    """A kept run as ``bench.async_vs_sync`` printed it (``runtime``: one of its ``other_runtimes``)."""
    name, _, key = name.partition("#")  # file#key: one of the runs a file keeps under "runs"
    d = json.loads((RESULTS / name).read_text())
    if key:
        d = d["runs"][key]
    if name == "h200_trainer_and_length_probe.json":
        d = d["untrained_16_token_responses"]
    r = dict(d.get("result", d))
    r.setdefault("command", d.get("command", ""))
    if r.get("partial"):  # an unfinished run: the seeds it finished, per policy
        r["policies"] = {pol: {"seeds": seeds} for pol, seeds in r["runs_so_far"][r["runtime"]].items()}
    if runtime:
        r["policies"], r["runtime"] = r["other_runtimes"][runtime], runtime
    return r


def _seeds(p: dict[str, Any]) -> list[dict[str, Any]]:
    return p.get("seeds") or [p]


def _measured(p: dict[str, Any]) -> float:
    """Trained tokens/s, the mean over the seeds (what the run's ``tokens_per_s.mean`` holds)."""
    vals = [s["tokens_per_s"] for s in _seeds(p)]
    return sum(vals) / len(vals)


def _flag(run: dict[str, Any], name: str) -> str | None:
    argv = shlex.split(run.get("command") or "")
    return argv[argv.index(name) + 1] if name in argv else None


def _group_size(run: dict[str, Any]) -> int:
    """Samples a prompt (``--n``): the run's batch over its prompts (``--batch-prompts``, default 8)."""
    return int(run["batch_size"]) // int(_flag(run, "--batch-prompts") or 8)


def _prompt_len(run: dict[str, Any]) -> int:
    """Prompt tokens per sample. text_arithmetic: ~30 (the trainer_step A/B of
    async_vs_sync_h200_text_v5_tail_mb16k.json uses --prompt-len 30; with SmolLM2's chat template
    the standalone section of async_vs_sync_h200_smollm2_steps.json measured 62); long_tail_copy:
    the string to copy (its mean length) plus a separator."""
    if run["task"] != "text_arithmetic":
        return 14
    return 62 if (run.get("task_kwargs") or {}).get("chat_template") else 30


def _warmup_steps(run: dict[str, Any], recorded: int | None) -> int:
    """Untimed trainer steps before the window: the JSON's field, else the last evaluation's step
    beyond the timed ones, else the command's flag, else what the setup table cites, else none."""
    if run.get("warmup_steps") is not None:
        return int(run["warmup_steps"])
    curve = next((s["eval_curve"] for p in run["policies"].values() for s in _seeds(p) if s.get("eval_curve")), None)
    if curve:
        return int(curve[-1][0]) - int(run["steps"])
    if _flag(run, "--warmup-steps"):
        return int(_flag(run, "--warmup-steps"))
    return recorded or 0


def _evals_in_window(run: dict[str, Any], warmup: int) -> int:
    every = int(run.get("eval_every") or 0)
    if not every or not run.get("eval_prompts"):
        return 0
    return sum(1 for s in range(warmup + 1, warmup + int(run["steps"]) + 1) if s % every == 0)


# ---------------------------------------------------------------------------------------------
# Component clocks -> model inputs
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Overheads:
    """The time no component clock holds, per setup (from its calibration run's sync policy)."""

    source: str
    sample_overhead_s: float
    """Rollout time per generated sample outside the engine's counted prefill and decode steps
    (result handling: detokenize, reward, hand-off): (rollout busy + evaluations - engine counted) /
    samples generated."""
    driver_overhead_s: float
    """Driver time per trainer step outside train, sync, evaluations and rollout."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One validated (or calibration) run and what it records beyond its JSON fields."""

    file: str
    runtime: str | None = None  # one of the file's ``other_runtimes``
    law: str = "geometric"  # response lengths: "geometric" (a model stopping at a constant rate) or "task"
    shape: str = "none"  # decode growth per row: a key of _per_row_ratio
    warmup_steps: int | None = None  # where the JSON does not record it
    overlap_push: bool = False
    in_flight: str = "abort"  # at a push: partial rollouts aborted and resumed, what every code did before
    #                           sync.in_flight existed; "keep" where the run records it
    why: str = ""  # the source of the facts above


def _train_s(run: dict[str, Any], s: dict[str, Any]) -> float:
    """The trainer's step: its own clock (``train_step_ms_mean``), or where older runs kept only the
    ratio, its busy seconds (1 - trainer_idle_ratio) x wall_s over the steps (the sum of its steps)."""
    if s.get("train_step_ms_mean"):
        return s["train_step_ms_mean"] / 1e3
    return (1.0 - s["trainer_idle_ratio"]) * s["wall_s"] / int(run["steps"])


def _engine_s(s: dict[str, Any]) -> tuple[float, float, int]:
    """(decode seconds, prefill seconds, decode steps) on the engine's counters."""
    e = s["engine"]
    decode = sum(e.get(f"decode_{p}_s") or 0.0 for p in ("launch", "wait", "post"))
    return decode, e["prefill_s"], int(e["num_decode_steps"])


def _lengths(run: dict[str, Any], spec: RunSpec, mean: float) -> LengthDist:
    cap = int(run["max_response_tokens"])
    if mean >= cap - 0.5:  # every response ran to the cap
        return LengthDist.fixed(cap)
    if spec.law == "geometric":
        return LengthDist.geometric(mean, cap)
    alpha = float((run.get("task_kwargs") or {}).get("tail_alpha") or 0.0)
    # text_arithmetic without a tail: sums of two 2-digit numbers, answers of 3 or 4 tokens
    return LengthDist.with_mean(mean, alpha if alpha > 0 else 8.0, cap)


def _push_s(s: dict[str, Any], sync_every: int) -> float:
    """One weight push: its parts' total (a mean over pushes), else ``sync_ms_mean`` (a mean over
    steps, 0 for a step without a push) times the steps per push."""
    parts = s.get("sync_parts_ms_mean") or {}
    return parts["total"] / 1e3 if parts.get("total") else s["sync_ms_mean"] * sync_every / 1e3


def seed_inputs(run: dict[str, Any], spec: RunSpec, s: dict[str, Any], ov: Overheads,
                sync_every: int = 1) -> Inputs:
    """The model's inputs for one seed of one policy, from that seed's component clocks."""
    steps, b = int(run["steps"]), int(run["batch_size"])
    decode_s, prefill_s, num_decode = _engine_s(s)
    rlen = float(s["response_len_mean"])
    e = s["engine"]
    # each prefilled sequence once (resubmitted partials again); where not counted, the batch per step
    # and the resumed share again
    prefilled = e.get("num_prefill_seqs") or b * steps * (1.0 + float(s.get("partial_ratio") or 0.0))
    rows = e.get("num_generated_tokens") or prefilled * rlen  # rows summed over decode steps
    ratio = _per_row_ratio(spec.shape)
    decode_base = decode_s / (num_decode + ratio * rows)
    parts = s.get("sync_parts_ms_mean") or {}
    push = _push_s(s, sync_every)
    warmup = _warmup_steps(run, spec.warmup_steps)
    return Inputs(decode_base_s=decode_base, decode_per_seq_s=decode_base * ratio,
                  prefill_per_token_s=0.0, prefill_per_seq_s=prefill_s / prefilled,
                  train_fixed_s=_train_s(run, s), train_per_token_s=0.0, push_s=push,
                  push_paused_s=parts["paused"] / 1e3 if parts.get("paused") else push / 2,
                  push_encode_s=parts["encode"] / 1e3 if parts.get("encode") else push / 2,
                  lengths=_lengths(run, spec, rlen), prompt_len=_prompt_len(run), samples_per_step=b,
                  group_size=_group_size(run), step_overhead_s=ov.driver_overhead_s,
                  max_running=_max_num_seqs(run), sample_overhead_s=ov.sample_overhead_s,
                  eval_every=int(run.get("eval_every") or 0) if _evals_in_window(run, warmup) else 0,
                  eval_samples=int(run.get("eval_prompts") or 0), eval_in_wall=bool(run.get("eval_in_window")))


def _max_num_seqs(run: dict[str, Any]) -> int:
    """The engines' ``max_num_seqs``: the run's override of it, else asyncrl's default."""
    for o in run.get("overrides") or []:
        if o.startswith("rollout.engine.max_num_seqs="):
            return int(o.split("=", 1)[1])
    return ENGINE_MAX_NUM_SEQS


def standalone_inputs(run: dict[str, Any], spec: RunSpec, s: dict[str, Any], ov: Overheads, policy: str,
                      sync_every: int = 1) -> Inputs:
    """The same, with what the run measured outside its timed window (its ``standalone`` section) in
    place of the engine's and the trainer's clocks: the engine alone at the policy's concurrency
    (decode step at two concurrencies, prefill, and its time outside the counted steps per sample)
    and the trainer alone on the runs' batch shape (scaled to this seed's tokens per step)."""
    st = run["standalone"]
    base, per_row = _line(_decode_steps_alone(st))
    at = st["engine"][str(st["engine_concurrency"][policy])]
    counted = sum(at["timing_s"][f"decode_{p}_s"] for p in ("launch", "wait", "post")) + at["timing_s"]["prefill_s"]
    bench_s = at["concurrency"] * at["response_tokens"] / at["tokens_per_s"]
    tokens = int(run["batch_size"]) * (st["prompt_tokens"] + float(s["response_len_mean"]))
    return dataclasses.replace(
        seed_inputs(run, spec, s, ov, sync_every), decode_base_s=base, decode_per_seq_s=per_row,
        prefill_per_seq_s=at["timing_s"]["prefill_s"] / at["concurrency"],
        sample_overhead_s=max(0.0, bench_s - counted) / at["concurrency"],
        train_fixed_s=st["trainer"]["step_ms"] / 1e3 * tokens / st["trainer"]["tokens_per_step"])


def schedule_of(run: dict[str, Any], policy: str, spec: RunSpec) -> Schedule:
    if policy in ("sync", "one_step_off"):
        return Schedule(policy)
    return Schedule("fully_async", staleness_threshold=float(run.get("staleness_threshold", 1.0)),
                    max_staleness=int(run.get("max_staleness", 2)), sync_every=2 if policy == "fully_async_k2" else 1,
                    in_flight=spec.in_flight, overlap_push=spec.overlap_push)  # type: ignore[arg-type]


def predict(inp: Inputs, sched: Schedule, steps: int, warmup: int) -> tuple[float, float, float]:
    """(trained tokens/s, decode steps per trainer step, evaluation seconds per trainer step),
    each the mean over the simulation seeds."""
    runs = [simulate(inp, sched, num_steps=steps, seed=SEED + i, warmup_steps=warmup) for i in range(NUM_SEEDS)]
    return (sum(r.trained_tokens_per_s for r in runs) / NUM_SEEDS,
            sum(r.decode_steps_per_step for r in runs) / NUM_SEEDS, sum(r.eval_s_per_step for r in runs) / NUM_SEEDS)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def predict_policy(run: dict[str, Any], spec: RunSpec, policy: str, ov: Overheads,
                   standalone: bool = False) -> dict[str, Any]:
    """Each seed predicted from its own inputs; the mean over seeds beside the measured mean, and
    two checks of the model against what the run counted (not inputs): decode steps per trainer
    step (the engine's counter: the length law's straggler) and evaluation seconds per step."""
    warmup, steps = _warmup_steps(run, spec.warmup_steps), int(run["steps"])
    sched = schedule_of(run, policy, spec)
    seeds = _seeds(run["policies"][policy])
    preds = [predict(standalone_inputs(run, spec, s, ov, policy, sched.sync_every) if standalone
                     else seed_inputs(run, spec, s, ov, sched.sync_every), sched, steps, warmup) for s in seeds]
    pred, meas = _mean([p[0] for p in preds]), _measured(run["policies"][policy])
    check = {"decode_steps_per_step": [round(_mean([p[1] for p in preds]), 1),
                                       round(_mean([_engine_s(s)[2] / steps for s in seeds]), 1)]}
    if _evals_in_window(run, warmup):
        check["eval_s_per_step"] = [round(_mean([p[2] for p in preds]), 4),
                                    round(_mean([float(s.get("eval_s") or 0.0) / steps for s in seeds]), 4)]
    return {"predicted_tokens_per_s": round(pred, 1), "measured_tokens_per_s": round(meas, 1),
            "relative_error": round((pred - meas) / meas, 3), "check_model_vs_counted": check}


def calibrate(spec: RunSpec) -> Overheads:
    """The two uncounted times of a setup, from its calibration run's sync policy (mean over seeds)."""
    run = _load(spec.file, spec.runtime)
    steps, b = int(run["steps"]), int(run["batch_size"])
    evals = _evals_in_window(run, _warmup_steps(run, spec.warmup_steps))
    sample, driver = [], []
    for s in _seeds(run["policies"]["sync"]):
        decode_s, prefill_s, _ = _engine_s(s)
        rollout_s = (1.0 - s["rollout_idle_ratio"]) * s["wall_s"]
        eval_s = float(s.get("eval_s") or 0.0)
        generated = b * steps + evals * int(run.get("eval_prompts") or 0)
        sample.append((rollout_s + eval_s - decode_s - prefill_s) / generated)
        in_wall_eval = eval_s if run.get("eval_in_window") else 0.0
        driver.append((s["wall_s"] - rollout_s - in_wall_eval) / steps - _train_s(run, s) - _push_s(s, 1))
    return Overheads(spec.file, max(0.0, _mean(sample)), max(0.0, _mean(driver)))


# ---------------------------------------------------------------------------------------------
# Setups: one calibration run each, the rest validated
# ---------------------------------------------------------------------------------------------

_TEXT = dict(law="task", shape="qwen05b")
SETUPS: dict[str, dict[str, Any]] = {
    "h200_402m_text_arithmetic": {
        "machine": "one NVIDIA H200 (lent), colocated, 402M bf16 (SFT warm start), text_arithmetic, process runtime",
        "calibrate": RunSpec("async_vs_sync_h200_text_v6_fair.json", **_TEXT),
        "validate": [
            RunSpec("async_vs_sync_h200_text_v5_tail_mb16k.json", **_TEXT),
            RunSpec("async_vs_sync_h200_text_v4_tail.json", **_TEXT),
            RunSpec("h200_trainer_and_length_probe.json", **_TEXT),
            RunSpec("async_vs_sync_h200_text_v3.json", **_TEXT),
            RunSpec("async_vs_sync_h200_text_plan_rebuilt.json", **_TEXT),
            RunSpec("async_vs_sync_h200_text.json", **_TEXT),
        ],
    },
    "h200_long_tail_copy": {
        "machine": "one NVIDIA H200 (lent), colocated, long_tail_copy (21-token vocabulary): 397k built-in "
                   "and 358M random weights, process and local runtimes",
        "calibrate": RunSpec("async_vs_sync_h200_process.json", warmup_steps=3,
                             why="warm-up: the code of 8bb7014 (its note), whose CPU run notes 3 warm-up steps"),
        "validate": [
            RunSpec("async_vs_sync_h200_process_overlap.json", overlap_push=True, warmup_steps=3,
                    why="its note: overlap_push always on at 6317f63; warm-up as 8bb7014's"),
            RunSpec("async_vs_sync_h200.json", why="its note: warmed by a separate untimed run, none in the window"),
            RunSpec("async_vs_sync_h200_diag.json", why="warm-up not recorded: none"),
            RunSpec("async_vs_sync_h200_direct.json", shape="qwen05b"),
            RunSpec("async_vs_sync_h200_direct.json", runtime="local", shape="qwen05b"),
        ],
    },
    "cpu_long_tail_copy": {
        "machine": "2-core x86_64 VM (shared), 397k built-in fp32, long_tail_copy, process, local and Ray runtimes",
        "calibrate": RunSpec("async_vs_sync_cpu_workers.json", warmup_steps=2, why="README command: --warmup-steps 2"),
        "validate": [
            RunSpec("async_vs_sync_cpu_workers.json", runtime="process:w2", warmup_steps=2,
                    why="README command: --warmup-steps 2"),
            RunSpec("async_vs_sync_cpu_direct.json", warmup_steps=4, why="README command: --warmup-steps 4"),
            RunSpec("async_vs_sync_cpu_direct.json", runtime="local", warmup_steps=4,
                    why="README command: --warmup-steps 4"),
            RunSpec("async_vs_sync_cpu.json", warmup_steps=3, why="its note: 3 untimed warm-up steps per run"),
            RunSpec("async_vs_sync_cpu_ray.json", why="warm-up not recorded: none"),
            RunSpec("clean_clone_e91d83a/async_vs_sync_cpu.json", why="warm-up not recorded: none"),
            RunSpec("async_vs_sync_cpu_7c1e492.json", warmup_steps=2, why="its command: --warmup-steps 2"),
        ],
    },
    "h200_smollm2_text_arithmetic": {
        "machine": "one NVIDIA H200 (lent), colocated, SmolLM2-135M-Instruct bf16 (pretrained), text_arithmetic "
                   "with the chat template, process runtime",
        "calibrate": RunSpec("async_vs_sync_h200_smollm2_fair.json", shape="smollm2"),
        "validate": [RunSpec("async_vs_sync_h200_smollm2_steps.json", shape="smollm2", in_flight="keep",
                             why="in-flight mode: README row, sync.in_flight auto (keep); its engines counted no "
                                 "aborts (engine.num_aborted 0) with samples running (engine.num_running 26-39)"),
                     *(RunSpec(f"async_vs_sync_h200_smollm2_knobs.json#{k}", shape="smollm2", in_flight="keep",
                               why="fully-async alone, one seed, no throw-away run; settings in the file "
                                   "(staleness_threshold, max_num_seqs, runtime), in-flight auto (keep)")
                       for k in "ABCD")],
    },
}

LEFT_OUT = {
    "async_vs_sync_h200_free_kv.json": "no engine counters: its seeds carry no `engine` record (decode steps, "
                                       "prefill seconds), the inputs every prediction is made from; its engines "
                                       "freed and re-allocated their KV cache at every push (free_kv: true), a "
                                       "cost on no other run's clocks",
    "async_vs_sync_h200_main_partial.txt": "no JSON: the log of an unfinished run (wall seconds per run only, no "
                                           "component times)",
    "async_vs_sync_h200_smollm2_eval_beside.json": "the run the forecast (--forecast) was made for, measured after "
                                                    "it (2.14x against the 2.47x predicted); not yet among the "
                                                    "validated runs, whose figures it would change",
    "async_vs_sync_h200_smollm2_mps.json": "one fully-async seed under NVIDIA MPS and no sync policy to calibrate "
                                           "on: kernels of two processes at once, which the model does not have",
    "async_vs_sync_h100_smollm2_graphs.json": "an H100 run: every setup is calibrated on H200 runs, and its "
                                              "graphed trainer's step is a clock no calibration run has",
    "async_vs_sync_h100_smollm2_graphs_local.json": "the same H100 lease, one seed under the local runtime",
    "async_vs_sync_h100_smollm2_graphs_mps.json": "the same H100 lease, one seed under NVIDIA MPS: kernels of two "
                                                  "processes at once, which the model does not have",
    "async_vs_sync_h100_smollm2_mps_2faf9d6.json": "an H100 run under NVIDIA MPS (runtime.mps): kernels of two "
                                                   "processes at once, which the model does not have",
    "async_vs_sync_h100_smollm2_mps_1c5d2f3.json": "the same, a later lease and code",
    "async_vs_sync_h100_smollm2_1c5d2f3.json": "an H100 run: every setup is calibrated on H200 runs, and its graphed "
                                               "trainer's step is a clock no calibration run has",
    "async_vs_sync_h100_smollm2_2dd85bc.json": "the same, a later lease and code (graph buckets reused)",
    "async_vs_sync_h100_smollm2_overlap5_2dd85bc.json": "the same lease, one seed with policy.eval_overlap_steps=5",
    "async_vs_sync_h100_smollm2_mps_sm70_2dd85bc.json": "the same lease, one seed under NVIDIA MPS with the trainer "
                                                        "capped at 70% of the SMs: kernels of two processes at once, "
                                                        "which the model does not have",
    "async_vs_sync_h200_smollm2_664443b.json": "an H200 run of the graphed trainer (as the H100 runs above): its step "
                                               "is a clock no calibration run has",
    "async_vs_sync_h100_smollm2_fused_head_d73e3e9.json": "an H100 run, one seed, of the graphed trainer with the "
                                                          "Triton head: a clock no calibration run has",
    "async_vs_sync_h100_smollm2_ca68ec2.json": "an H100 run, 3 seeds, of the graphed trainer with the Triton head: "
                                               "a clock no calibration run has",
    "async_vs_sync_h100_smollm2_staleness6_ca68ec2.json": "the same code on another H100 lease, fully-async at "
                                                          "staleness_threshold 6, max_staleness 8",
    "async_vs_sync_h100_smollm2_staleness6_overlap7_ca68ec2.json": "the same lease, with "
                                                                   "policy.eval_overlap_steps=7",
    "async_vs_sync_h100_smollm2_staleness6_7ec1f3f.json": "an H100 run, 3 seeds, of the graphed trainer with the "
                                                          "Triton RMSNorm: a clock no calibration run has",
    "async_vs_sync_h100_smollm2_staleness6_evalend_7ec1f3f.json": "the same lease, no evaluation in the window",
    "async_vs_sync_h100_smollm2_staleness6_warm10_evalend_41990f0.json": "another H100 lease, 10 warm-up steps, "
                                                                         "no evaluation in the window",
    "async_vs_sync_h100_smollm2_staleness6_warm10_41990f0.json": "the same lease, 10 warm-up steps",
}


def _label(spec: RunSpec) -> str:
    name, _, key = spec.file.partition("#")
    return name + (f" [{spec.runtime}]" if spec.runtime else "") + (f" [{key}]" if key else "")


INPUTS = {
    "per seed of the predicted policy (its component clocks and workload)": [
        "engine.decode_launch_s + decode_wait_s + decode_post_s over engine.num_decode_steps: the decode step, "
        "split into a step at no rows and a growth per row by the model shape's standalone ratio (rows: "
        "engine.num_generated_tokens, or prefilled sequences x response_len_mean)",
        "engine.prefill_s over engine.num_prefill_seqs: a prefill per sequence (where not counted: "
        "batch_size x steps x (1 + partial_ratio))",
        "train_step_ms_mean; where a run kept only trainer_idle_ratio: (1 - trainer_idle_ratio) x wall_s / "
        "steps, the trainer's busy seconds",
        "sync_parts_ms_mean.total (one push), .paused, .encode; where absent: sync_ms_mean x steps per push, "
        "halves",
        "response_len_mean: the lengths' mean (the law: geometric for a model that stops at a constant rate "
        "per token, the task's for the warm-started text model; fixed where every response ran to the cap)"],
    "per run (configuration)": [
        "batch_size, --batch-prompts (group size), max_response_tokens, staleness_threshold, max_staleness, "
        "eval_every, eval_prompts, eval_in_window, warmup_steps (else the eval curve's last step, the "
        "command's flag or the note cited in recorded_where), overlap_push (the note cited), in-flight mode "
        "(abort, the partial rollouts of every code before sync.in_flight; keep where the run records it), "
        "engine max_num_seqs 128"],
    "per setup (the calibration run's sync policy)": [
        "sample_overhead_ms: (rollout busy + evaluation seconds - engine counted seconds) / samples generated",
        "driver_overhead_ms: (wall - rollout busy - in-window evaluations) / steps - train step - push"],
    "never an input of a run's own prediction": [
        "tokens_per_s, samples_per_s, steps_per_s, wall_s (but for the trainer's busy seconds above), "
        "rollout_idle_ratio, engine_busy_ratio, engine_tokens_per_s, engine_decode_rows_mean, eval_s, "
        "pipeline_efficiency"],
}


def validate() -> dict[str, Any]:
    out: dict[str, Any] = {
        "bench": "simulate --validate",
        "machine": _machine(),
        "method": " ".join(__doc__.split("\n\n")[2].split()),
        "inputs": INPUTS, "setups": {}, "left_out": LEFT_OUT, "runs": [],
    }
    errors = []
    for setup, spec in SETUPS.items():
        cal = spec["calibrate"]
        ov = calibrate(cal)
        run = _load(cal.file, cal.runtime)
        out["setups"][setup] = {
            "machine": spec["machine"], "calibrated_on": _label(cal),
            "overheads": {"sample_overhead_ms": round(ov.sample_overhead_s * 1e3, 3),
                          "driver_overhead_ms": round(ov.driver_overhead_s * 1e3, 3)},
            "calibration_run": {pol: {"role": "calibrated on (in-sample)" if pol == "sync" else
                                      "held out, not counted", **predict_policy(run, cal, pol, ov)}
                                for pol in run["policies"]}}
        for vs in spec["validate"]:
            run = _load(vs.file, vs.runtime)
            row: dict[str, Any] = {"run": _label(vs), "setup": setup, "steps": run["steps"],
                                   "batch_size": run["batch_size"],
                                   "seeds": len(_seeds(next(iter(run["policies"].values())))),
                                   "warmup_steps": _warmup_steps(run, vs.warmup_steps),
                                   "in_flight": vs.in_flight, "overlap_push": vs.overlap_push,
                                   "recorded_where": vs.why or "the JSON", "policies": {}}
            for policy in run["policies"]:
                row["policies"][policy] = predict_policy(run, vs, policy, ov)
                errors.append(abs(row["policies"][policy]["relative_error"]))
            if len((run.get("standalone") or {}).get("engine", {})) >= 2:  # a decode line needs two concurrencies
                row["standalone_inputs"] = {
                    "what": "not counted: the same prediction with the engine's and the trainer's clocks replaced "
                            "by the run's standalone section (measured outside the timed window); the push keeps "
                            "its clock (no standalone push)",
                    **{pol: predict_policy(run, vs, pol, ov, standalone=True) for pol in run["policies"]}}
            out["runs"].append(row)
    out["max_abs_relative_error"] = round(max(errors), 3)
    out["within_20_percent"] = sum(e <= 0.2 for e in errors)
    out["predictions"] = len(errors)
    out["all_within_20_percent"] = out["within_20_percent"] == len(errors)
    return out


# What-if: the kept SmolLM2 step-by-step runs, re-scheduled with evaluations beside training
# (policy.eval_overlap_steps, built after they ran). Every input is the runs' own clocks.
FORECAST_SETUP = "h200_smollm2_text_arithmetic"
FORECAST_SYNC = RunSpec("async_vs_sync_h200_smollm2_steps.json", shape="smollm2", in_flight="keep")
FORECAST_FULLY_ASYNC = {
    "staleness 2, 128 seqs (the paired run's fully-async, 3 seeds)": FORECAST_SYNC,
    "staleness 4, 256 seqs (knobs run C, 1 seed)": RunSpec("async_vs_sync_h200_smollm2_knobs.json#C",
                                                           shape="smollm2", in_flight="keep"),
}
FORECAST_OVERLAP = 2  # policy.eval_overlap_steps' default


def _forecast_policy(run: dict[str, Any], spec: RunSpec, policy: str, ov: Overheads,
                     max_staleness: int | None = None) -> dict[str, float]:
    """Trained tokens/s predicted from each seed's clocks: evaluations waited for (as the run had
    them; a check against what it measured) and beside training."""
    warmup, steps = _warmup_steps(run, spec.warmup_steps), int(run["steps"])
    sched = schedule_of(run, policy, spec)
    if max_staleness is not None:
        sched = dataclasses.replace(sched, max_staleness=max_staleness)
    seeds = [seed_inputs(run, spec, s, ov, sched.sync_every) for s in _seeds(run["policies"][policy])]
    waited = _mean([predict(i, sched, steps, warmup)[0] for i in seeds])
    beside = _mean([predict(i, dataclasses.replace(sched, eval_overlap_steps=FORECAST_OVERLAP), steps, warmup)[0]
                    for i in seeds])
    return {"measured": round(_measured(run["policies"][policy]), 1), "predicted_waited": round(waited, 1),
            "predicted_beside": round(beside, 1)}


def forecast() -> dict[str, Any]:
    """fully-async / sync, trained tokens/s, predicted for the kept SmolLM2 runs with evaluations
    beside training, next to the same prediction with evaluations waited for (as they ran)."""
    ov = calibrate(SETUPS[FORECAST_SETUP]["calibrate"])
    sync = _forecast_policy(_load(FORECAST_SYNC.file), FORECAST_SYNC, "sync", ov)
    out: dict[str, Any] = {
        "bench": "simulate --forecast", "machine": _machine(),
        "what": "a prediction, not a measurement: the kept H200 SmolLM2-135M-Instruct step-by-step runs "
                "(10 timed steps, an evaluation of 64 prompts every 5 steps inside the window) re-scheduled "
                f"by bench.simulate_model with evaluations beside training (policy.eval_overlap_steps "
                f"{FORECAST_OVERLAP}), from each seed's own component clocks; the waited-for prediction "
                "checks the model against what the run measured",
        "unit": "trained tokens/s", "sync": sync, "fully_async": {}}
    for label, spec in FORECAST_FULLY_ASYNC.items():
        run = _load(spec.file)
        rows = {"as run": _forecast_policy(run, spec, "fully_async", ov),
                "max_staleness 6": _forecast_policy(run, spec, "fully_async", ov, max_staleness=6)}
        for row in rows.values():
            row["over_sync_measured_waited"] = round(row["measured"] / sync["measured"], 2)
            row["over_sync_predicted_waited"] = round(row["predicted_waited"] / sync["predicted_waited"], 2)
            row["over_sync_predicted_beside"] = round(row["predicted_beside"] / sync["predicted_beside"], 2)
        out["fully_async"][label] = rows
    return out


# Levers: the kept H100 run of the graphed trainer (cd64b15), each of what limits fully-async
# against sync taken away in the model, alone and together. Every input is the run's own clocks.
LEVERS_RUN = RunSpec("async_vs_sync_h100_smollm2_graphs.json", shape="smollm2", in_flight="keep",
                     why="in-flight mode: sync.in_flight auto (keep) for the built-in engine")
MPS_TRAINER_BESIDE = 1.08  # trainer step beside a generating engine over its standalone step, under NVIDIA MPS
#                             (async_vs_sync_h100_smollm2_graphs_mps.json: 113 ms against 105 ms alone)
LEVERS = {
    "as run": dict(),
    "engine at its standalone speed": dict(engine=True),
    "trainer beside the engine at 1.08x its standalone step (MPS)": dict(trainer=True),
    "staleness 8, max_staleness 10": dict(staleness=(8.0, 10)),
    "engine + trainer": dict(engine=True, trainer=True),
    "engine + trainer + staleness 8": dict(engine=True, trainer=True, staleness=(8.0, 10)),
}


def _lever_inputs(run: dict[str, Any], spec: RunSpec, s: dict[str, Any], ov: Overheads, policy: str,
                  engine: bool = False, trainer: bool = False) -> Inputs:
    """One seed's inputs with the engine's clocks (decode, prefill, per-sample handling) and/or the
    trainer's replaced by the run's standalone ones; fully-async's trainer at ``MPS_TRAINER_BESIDE``
    its standalone step (sync's trains alone, at its standalone step)."""
    loop_in = seed_inputs(run, spec, s, ov)
    alone = standalone_inputs(run, spec, s, ov, policy)
    out = loop_in
    if engine:
        out = dataclasses.replace(out, decode_base_s=alone.decode_base_s, decode_per_seq_s=alone.decode_per_seq_s,
                                  prefill_per_seq_s=alone.prefill_per_seq_s, sample_overhead_s=alone.sample_overhead_s)
    if trainer:
        out = dataclasses.replace(out, train_fixed_s=alone.train_fixed_s * (
            MPS_TRAINER_BESIDE if policy == "fully_async" else 1.0))
    return out


def levers() -> dict[str, Any]:
    """Trained tokens/s of sync and fully-async predicted with each lever applied (a what-if)."""
    spec = LEVERS_RUN
    run = _load(spec.file)
    ov = calibrate(spec)  # on this run's own sync policy: no other H100 run to calibrate on
    warmup, steps = _warmup_steps(run, spec.warmup_steps), int(run["steps"])
    out: dict[str, Any] = {
        "bench": "simulate --levers", "machine": _machine(),
        "what": "a prediction, not a measurement: the kept H100 SmolLM2-135M-Instruct step-by-step run with the "
                "graphed trainer (3 seeds, 10 timed steps, evaluations beside training) re-scheduled by "
                "bench.simulate_model from each seed's own clocks, with what limits fully-async taken away one "
                "lever at a time: the engine at its standalone decode step, prefill and per-sample time (the "
                "run's standalone section); the trainer beside the engine at 1.08x its standalone step (as "
                "measured under NVIDIA MPS); a wider staleness window. Calibrated on the run's own sync policy "
                "(in-sample: the 'as run' sync row checks nothing); 'as run' fully-async checks the model",
        "run": spec.file, "unit": "trained tokens/s",
        "measured": {pol: round(_measured(run["policies"][pol]), 1) for pol in ("sync", "fully_async")},
        "levers": {}}
    out["measured"]["fully_async_over_sync"] = round(out["measured"]["fully_async"] / out["measured"]["sync"], 2)
    for label, lever in LEVERS.items():
        row: dict[str, Any] = {}
        for policy in ("sync", "fully_async"):
            sched = dataclasses.replace(schedule_of(run, policy, spec), eval_overlap_steps=FORECAST_OVERLAP)
            if policy == "fully_async" and "staleness" in lever:
                threshold, max_staleness = lever["staleness"]
                sched = dataclasses.replace(sched, staleness_threshold=threshold, max_staleness=max_staleness)
            seeds = [_lever_inputs(run, spec, s, ov, policy, lever.get("engine", False), lever.get("trainer", False))
                     for s in _seeds(run["policies"][policy])]
            row[policy] = round(_mean([predict(i, sched, steps, warmup)[0] for i in seeds]), 1)
        row["fully_async_over_sync"] = round(row["fully_async"] / row["sync"], 2)
        out["levers"][label] = row
    return out


def _machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return (f"{platform.machine()} VM, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"load {tuple(round(x, 2) for x in load) if load else 'n/a'} (the simulation itself; no GPU)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--validate", action="store_true", help="predicted vs measured on kept runs not calibrated on")
    ap.add_argument("--forecast", action="store_true",
                    help="the kept SmolLM2 runs re-scheduled with evaluations beside training (a prediction)")
    ap.add_argument("--levers", action="store_true",
                    help="the H100 graphed-trainer run with each limit of fully-async taken away (a prediction)")
    ap.add_argument("--model", default="0.5b,7b", help="model sizes for scaling predictions: 0.5b, 7b")
    ap.add_argument("--gpus", default="8,32,128", help="total GPU counts, comma-separated")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.validate:
        result = validate()
    elif args.forecast:
        result = forecast()
    elif args.levers:
        result = levers()
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
