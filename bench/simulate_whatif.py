"""What-ifs on kept runs, from their own in-loop clocks: ``--forecast`` and ``--levers``.

Each seed of a kept run is re-scheduled by ``bench.simulate_model`` from what its parts cost in
that run (the engine's decode-step and prefill counters, the trainer's step, the weight syncs),
its mean response length under a geometric law and its configuration; two per-run constants
cover the time no component clock holds (the rollout's time per sample outside the engine's
counted steps, the driver's per step outside train, sync and evaluations), from a calibration
run's sync policy. Then one thing is changed (evaluations beside training, the engine at its
standalone speed, a wider staleness window) and the prediction set beside the run's. These are
predictions about the run, not forecasts from standalone figures (``bench.simulate_validate``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.simulate_model import Inputs, LengthDist, Schedule, simulate
from bench.simulate_validate import _decode_steps, _flag, _group_size, _line, _load, _max_num_seqs, _mean, _seeds
from bench.simulate_validate import measured as _measured

SEED = 0
NUM_SEEDS = 3  # simulation seeds averaged per prediction (the lengths are random)
PROMPT_LEN = 62  # SmolLM2's chat template on text_arithmetic (the runs' standalone.prompt_tokens)
# The SmolLM2 decode step's growth per row over its step at no rows: the standalone engine of the
# step-by-step run (64 and 128 rows). The counters give one mean step; this splits it.
SHAPE_RUN = "async_vs_sync_h200_smollm2_steps.json"


def _per_row_ratio() -> float:
    base, per_row = _line(_decode_steps(_load(SHAPE_RUN)["standalone"]))
    return per_row / base


def _warmup_steps(run: dict[str, Any]) -> int:
    """Untimed trainer steps before the window: the JSON's field, else the last evaluation's step
    beyond the timed ones, else the command's flag, else none."""
    if run.get("warmup_steps") is not None:
        return int(run["warmup_steps"])
    curve = next((s["eval_curve"] for p in run["policies"].values() for s in _seeds(p) if s.get("eval_curve")), None)
    if curve:
        return int(curve[-1][0]) - int(run["steps"])
    return int(_flag(run, "--warmup-steps") or 0)


def _evals_in_window(run: dict[str, Any], warmup: int) -> int:
    every = int(run.get("eval_every") or 0)
    if not every or not run.get("eval_prompts"):
        return 0
    return sum(1 for s in range(warmup + 1, warmup + int(run["steps"]) + 1) if s % every == 0)


@dataclasses.dataclass(frozen=True)
class Overheads:
    """The time no component clock holds (from a calibration run's sync policy)."""

    source: str
    sample_overhead_s: float
    """Rollout time per generated sample outside the engine's counted prefill and decode steps
    (result handling: detokenize, reward, hand-off): (rollout busy + evaluations - engine counted) /
    samples generated."""
    driver_overhead_s: float
    """Driver time per trainer step outside train, sync, evaluations and rollout."""


def _engine_s(s: dict[str, Any]) -> tuple[float, float, int]:
    """(decode seconds, prefill seconds, decode steps) on the engine's counters."""
    e = s["engine"]
    decode = sum(e.get(f"decode_{p}_s") or 0.0 for p in ("launch", "wait", "post"))
    return decode, e["prefill_s"], int(e["num_decode_steps"])


def _push_s(s: dict[str, Any]) -> float:
    """One weight push: its parts' total (a mean over pushes)."""
    return s["sync_parts_ms_mean"]["total"] / 1e3


def seed_inputs(run: dict[str, Any], s: dict[str, Any], ov: Overheads) -> Inputs:
    """The model's inputs for one seed of one policy, from that seed's component clocks."""
    b = int(run["batch_size"])
    decode_s, prefill_s, num_decode = _engine_s(s)
    e, parts = s["engine"], s["sync_parts_ms_mean"]
    ratio = _per_row_ratio()
    decode_base = decode_s / (num_decode + ratio * e["num_generated_tokens"])
    cap = int(run["max_response_tokens"])
    return Inputs(decode_base_s=decode_base, decode_per_seq_s=decode_base * ratio,
                  prefill_per_token_s=0.0, prefill_per_seq_s=prefill_s / e["num_prefill_seqs"],
                  train_fixed_s=s["train_step_ms_mean"] / 1e3, train_per_token_s=0.0, push_s=_push_s(s),
                  push_paused_s=parts["paused"] / 1e3, push_encode_s=parts["encode"] / 1e3,
                  lengths=LengthDist.geometric(float(s["response_len_mean"]), cap), prompt_len=PROMPT_LEN,
                  samples_per_step=b, group_size=_group_size(run), step_overhead_s=ov.driver_overhead_s,
                  max_running=_max_num_seqs(run), sample_overhead_s=ov.sample_overhead_s,
                  eval_every=int(run.get("eval_every") or 0) if _evals_in_window(run, _warmup_steps(run)) else 0,
                  eval_samples=int(run.get("eval_prompts") or 0), eval_in_wall=bool(run.get("eval_in_window")))


def standalone_inputs(run: dict[str, Any], s: dict[str, Any], ov: Overheads, policy: str) -> Inputs:
    """The same, with what the run measured outside its timed window (its ``standalone`` section) in
    place of the engine's and the trainer's clocks: the engine alone at the policy's concurrency
    (decode step at two concurrencies, prefill, and its time outside the counted steps per sample)
    and the trainer alone on the runs' batch shape (scaled to this seed's tokens per step)."""
    st = run["standalone"]
    base, per_row = _line(_decode_steps(st))
    at = st["engine"][str(st["engine_concurrency"][policy])]
    counted = sum(at["timing_s"][f"decode_{p}_s"] for p in ("launch", "wait", "post")) + at["timing_s"]["prefill_s"]
    bench_s = at["concurrency"] * at["response_tokens"] / at["tokens_per_s"]
    tokens = int(run["batch_size"]) * (st["prompt_tokens"] + float(s["response_len_mean"]))
    return dataclasses.replace(
        seed_inputs(run, s, ov), decode_base_s=base, decode_per_seq_s=per_row,
        prefill_per_seq_s=at["timing_s"]["prefill_s"] / at["concurrency"],
        sample_overhead_s=max(0.0, bench_s - counted) / at["concurrency"],
        train_fixed_s=st["trainer"]["step_ms"] / 1e3 * tokens / st["trainer"]["tokens_per_step"])


def schedule_of(run: dict[str, Any], policy: str) -> Schedule:
    """The run's policy; the SmolLM2 runs keep in-flight samples at a push (``sync.in_flight`` auto)."""
    if policy in ("sync", "one_step_off"):
        return Schedule(policy)
    return Schedule("fully_async", staleness_threshold=float(run.get("staleness_threshold", 1.0)),
                    max_staleness=int(run.get("max_staleness", 2)), in_flight="keep")


def predict(inp: Inputs, sched: Schedule, steps: int, warmup: int) -> float:
    """Trained tokens/s, the mean over the simulation seeds."""
    return _mean([simulate(inp, sched, num_steps=steps, seed=SEED + i, warmup_steps=warmup).trained_tokens_per_s
                  for i in range(NUM_SEEDS)])


def calibrate(name: str) -> Overheads:
    """The two uncounted times from a run's sync policy (mean over seeds)."""
    run = _load(name)
    steps, b = int(run["steps"]), int(run["batch_size"])
    evals = _evals_in_window(run, _warmup_steps(run))
    sample, driver = [], []
    for s in _seeds(run["policies"]["sync"]):
        decode_s, prefill_s, _ = _engine_s(s)
        rollout_s = (1.0 - s["rollout_idle_ratio"]) * s["wall_s"]
        eval_s = float(s.get("eval_s") or 0.0)
        generated = b * steps + evals * int(run.get("eval_prompts") or 0)
        sample.append((rollout_s + eval_s - decode_s - prefill_s) / generated)
        in_wall_eval = eval_s if run.get("eval_in_window") else 0.0
        driver.append((s["wall_s"] - rollout_s - in_wall_eval) / steps - s["train_step_ms_mean"] / 1e3 - _push_s(s))
    return Overheads(name, max(0.0, _mean(sample)), max(0.0, _mean(driver)))


# What-if: the kept SmolLM2 step-by-step runs, re-scheduled with evaluations beside training
# (policy.eval_overlap_steps, built after they ran). Every input is the runs' own clocks.
FORECAST_CALIBRATE = "async_vs_sync_h200_smollm2_fair.json"  # the SmolLM2 H200 runs' sync overheads
FORECAST_SYNC = "async_vs_sync_h200_smollm2_steps.json"
FORECAST_FULLY_ASYNC = {
    "staleness 2, 128 seqs (the paired run's fully-async, 3 seeds)": FORECAST_SYNC,
    "staleness 4, 256 seqs (knobs run C, 1 seed)": "async_vs_sync_h200_smollm2_knobs.json#C",
}
FORECAST_OVERLAP = 2  # policy.eval_overlap_steps' default


def _forecast_policy(run: dict[str, Any], policy: str, ov: Overheads,
                     max_staleness: int | None = None) -> dict[str, float]:
    """Trained tokens/s predicted from each seed's clocks: evaluations waited for (as the run had
    them; a check against what it measured) and beside training."""
    warmup, steps = _warmup_steps(run), int(run["steps"])
    sched = schedule_of(run, policy)
    if max_staleness is not None:
        sched = dataclasses.replace(sched, max_staleness=max_staleness)
    seeds = [seed_inputs(run, s, ov) for s in _seeds(run["policies"][policy])]
    waited = _mean([predict(i, sched, steps, warmup) for i in seeds])
    beside = _mean([predict(i, dataclasses.replace(sched, eval_overlap_steps=FORECAST_OVERLAP), steps, warmup)
                    for i in seeds])
    return {"measured": round(_measured(run["policies"][policy]), 1), "predicted_waited": round(waited, 1),
            "predicted_beside": round(beside, 1)}


def forecast(machine: str) -> dict[str, Any]:
    """fully-async / sync, trained tokens/s, predicted for the kept SmolLM2 runs with evaluations
    beside training, next to the same prediction with evaluations waited for (as they ran)."""
    ov = calibrate(FORECAST_CALIBRATE)
    sync = _forecast_policy(_load(FORECAST_SYNC), "sync", ov)
    out: dict[str, Any] = {
        "bench": "simulate --forecast", "machine": machine,
        "what": "a prediction, not a measurement: the kept H200 SmolLM2-135M-Instruct step-by-step runs "
                "(10 timed steps, an evaluation of 64 prompts every 5 steps inside the window) re-scheduled "
                f"by bench.simulate_model with evaluations beside training (policy.eval_overlap_steps "
                f"{FORECAST_OVERLAP}), from each seed's own component clocks; the waited-for prediction "
                "checks the model against what the run measured",
        "unit": "trained tokens/s", "sync": sync, "fully_async": {}}
    for label, name in FORECAST_FULLY_ASYNC.items():
        run = _load(name)
        rows = {"as run": _forecast_policy(run, "fully_async", ov),
                "max_staleness 6": _forecast_policy(run, "fully_async", ov, max_staleness=6)}
        for row in rows.values():
            row["over_sync_measured_waited"] = round(row["measured"] / sync["measured"], 2)
            row["over_sync_predicted_waited"] = round(row["predicted_waited"] / sync["predicted_waited"], 2)
            row["over_sync_predicted_beside"] = round(row["predicted_beside"] / sync["predicted_beside"], 2)
        out["fully_async"][label] = rows
    return out


# Levers: the kept H100 run of the graphed trainer (cd64b15), each of what limits fully-async
# against sync taken away in the model, alone and together. Every input is the run's own clocks.
LEVERS_RUN = "async_vs_sync_h100_smollm2_graphs.json"
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


def _lever_inputs(run: dict[str, Any], s: dict[str, Any], ov: Overheads, policy: str,
                  engine: bool = False, trainer: bool = False) -> Inputs:
    """One seed's inputs with the engine's clocks (decode, prefill, per-sample handling) and/or the
    trainer's replaced by the run's standalone ones; fully-async's trainer at ``MPS_TRAINER_BESIDE``
    its standalone step (sync's trains alone, at its standalone step)."""
    loop_in = seed_inputs(run, s, ov)
    alone = standalone_inputs(run, s, ov, policy)
    out = loop_in
    if engine:
        out = dataclasses.replace(out, decode_base_s=alone.decode_base_s, decode_per_seq_s=alone.decode_per_seq_s,
                                  prefill_per_seq_s=alone.prefill_per_seq_s, sample_overhead_s=alone.sample_overhead_s)
    if trainer:
        out = dataclasses.replace(out, train_fixed_s=alone.train_fixed_s * (
            MPS_TRAINER_BESIDE if policy == "fully_async" else 1.0))
    return out


def levers(machine: str) -> dict[str, Any]:
    """Trained tokens/s of sync and fully-async predicted with each lever applied (a what-if)."""
    run = _load(LEVERS_RUN)
    ov = calibrate(LEVERS_RUN)  # on this run's own sync policy
    warmup, steps = _warmup_steps(run), int(run["steps"])
    out: dict[str, Any] = {
        "bench": "simulate --levers", "machine": machine,
        "what": "a prediction, not a measurement: the kept H100 SmolLM2-135M-Instruct step-by-step run with the "
                "graphed trainer (3 seeds, 10 timed steps, evaluations beside training) re-scheduled by "
                "bench.simulate_model from each seed's own clocks, with what limits fully-async taken away one "
                "lever at a time: the engine at its standalone decode step, prefill and per-sample time (the "
                "run's standalone section); the trainer beside the engine at 1.08x its standalone step (as "
                "measured under NVIDIA MPS); a wider staleness window. Calibrated on the run's own sync policy "
                "(in-sample: the 'as run' sync row checks nothing); 'as run' fully-async checks the model",
        "run": LEVERS_RUN, "unit": "trained tokens/s",
        "measured": {pol: round(_measured(run["policies"][pol]), 1) for pol in ("sync", "fully_async")},
        "levers": {}}
    out["measured"]["fully_async_over_sync"] = round(out["measured"]["fully_async"] / out["measured"]["sync"], 2)
    for label, lever in LEVERS.items():
        row: dict[str, Any] = {}
        for policy in ("sync", "fully_async"):
            sched = dataclasses.replace(schedule_of(run, policy), eval_overlap_steps=FORECAST_OVERLAP)
            if policy == "fully_async" and "staleness" in lever:
                threshold, max_staleness = lever["staleness"]
                sched = dataclasses.replace(sched, staleness_threshold=threshold, max_staleness=max_staleness)
            seeds = [_lever_inputs(run, s, ov, policy, lever.get("engine", False), lever.get("trainer", False))
                     for s in _seeds(run["policies"][policy])]
            row[policy] = round(_mean([predict(i, sched, steps, warmup) for i in seeds]), 1)
        row["fully_async_over_sync"] = round(row["fully_async"] / row["sync"], 2)
        out["levers"][label] = row
    return out
