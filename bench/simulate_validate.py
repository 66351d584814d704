"""``python -m bench.simulate --validate``: kept runs forecast from what a user has before running.

    standalone figures of the setup ─┐  engine decode step against rows, prefill, its tokens/s;
    (bench.engine, bench.trainer_step,│  trainer step at the run's tokens; push by transport;
     bench.weight_sync, a throw-away ─┤  the mean response length of a throw-away run
     run's mean response length)      │
                                      ├─► bench.simulate_model ─► trained tokens/s per policy
    the interference model ───────────┘        (and beside it the naive predictor's)
    (bench/results/simulate/simulate_interference.json:
     fit once on a few named calibration runs)

A kept ``bench.async_vs_sync`` run's policies are predicted from its setup's standalone
figures (the run's ``standalone`` section: measured in the bench's process before the timed
runs, outside them; where a run has none, a named sibling's of the same lease, code and
model), its configuration (batch, group size, response cap, staleness, evaluations, warm-up)
and the interference model. The model is fit once, on the calibration runs named in its
file, from their standalone figures set against their in-loop component clocks; those runs
are not validated. No validated run's in-loop clock, throughput, idle ratio, response length
or wall time is read. Beside each prediction: the naive predictor from the same inputs
(sync: engine + trainer + push times per step; fully-async: the larger of engine and trainer
times, each slowed by the interference model).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path
from typing import Any

from bench.simulate_model import Inputs, Interference, LengthDist, Schedule, simulate

RESULTS = Path(__file__).resolve().parent / "results"
INTERFERENCE_FILE = RESULTS / "simulate" / "simulate_interference.json"
SEED = 0
NUM_SEEDS = 3  # simulation seeds averaged per prediction (the lengths are random)
GOAL = 0.25  # issue 47: every kept GPU run within 25%
ENGINE_MAX_NUM_SEQS = 128  # actors/engines/config.py's max_num_seqs
EVAL_OVERLAP_DEFAULT = 2  # policy.eval_overlap_steps' default since bb7c3cf


# ---------------------------------------------------------------------------------------------
# Kept runs
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A kept run and what it records outside its JSON fields."""

    file: str  # "name.json" or "name.json#key" (one of the runs a file keeps under "runs")
    era: str = "bb7c3cf"
    """The loop's code: ``bb7c3cf`` (evaluations beside training, ``policy.eval_overlap_steps``
    2 unless the command overrides it; actor processes started ahead) or ``before``
    (the trainer waited for each evaluation)."""
    standalone_from: str | None = None
    """A sibling (same lease, code and model) whose ``standalone`` section stands for this
    run's, which has none or one without the policy's concurrency."""
    trainer_from: str | None = None
    """A ``bench.trainer_step`` result of the same lease and code whose step stands for the
    ``standalone.trainer`` section's (where that section's repeats caught graph captures)."""
    lengths_from: str | None = None
    """A run of the same model, task and cap whose throw-away run's mean response length
    stands for this run's (this one measured none: its bench used half the cap)."""
    why: str = ""


def kept(name: str) -> Path:
    """A kept result by its name in its benchmark's folder: ``<bench>/<name>`` while it is
    current, ``archive/<bench>/<name>`` once superseded (``bench/results/README.md``). A run
    is named the same wherever it is filed, so archiving one changes no forecast."""
    hits = sorted(RESULTS.glob(f"*/{name}")) + sorted(RESULTS.glob(f"archive/*/{name}"))
    if len(hits) != 1:
        raise FileNotFoundError(f"{name}: {len(hits)} kept files of that name under {RESULTS} "
                                f"({', '.join(str(h.relative_to(RESULTS)) for h in hits) or 'none'})")
    return hits[0]


def _load(name: str) -> dict[str, Any]:
    """A kept run as ``bench.async_vs_sync`` printed it."""
    name, _, key = name.partition("#")
    d = json.loads(kept(name).read_text())
    if key:
        d = d["runs"][key]
    r = dict(d.get("result", d))
    r.setdefault("command", d.get("command", ""))
    return r


def _seeds(p: dict[str, Any]) -> list[dict[str, Any]]:
    return p.get("seeds") or [p]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def measured(p: dict[str, Any]) -> float:
    """Trained tokens/s, the mean over the seeds (what the run's ``tokens_per_s.mean`` holds)."""
    return _mean([s["tokens_per_s"] for s in _seeds(p)])


def _override(run: dict[str, Any], key: str) -> str | None:
    for o in run.get("overrides") or []:
        if o.startswith(key + "="):
            return o.split("=", 1)[1]
    return None


def _flag(run: dict[str, Any], name: str) -> str | None:
    argv = shlex.split(run.get("command") or "")
    return argv[argv.index(name) + 1] if name in argv else None


def _gpu(spec: RunSpec) -> str:
    name = spec.file.split("#")[0]
    for m in ("h100", "h200"):
        if f"_{m}_" in name or name.endswith(f"_{m}.json"):
            return m
    raise ValueError(f"{spec.file}: no machine in its name")


# ---------------------------------------------------------------------------------------------
# Standalone figures
# ---------------------------------------------------------------------------------------------

# Push by machine, model shape and transport: bench.weight_sync's median whole push (CUDA IPC,
# SmolLM2-135M shape). A file of the run's code where one was kept, else the machine's latest.
PUSH_FILES = {
    "h100": {"41990f0": "weight_sync_h100_smollm2_41990f0.json", "ca68ec2": "weight_sync_h100_smollm2_ca68ec2.json",
             "d73e3e9": "weight_sync_h100_smollm2_d73e3e9.json", "": "weight_sync_h100_smollm2_41990f0.json"},
    "h200": {"664443b": "weight_sync_h200_smollm2_664443b.json", "94a4d22": "weight_sync_h200_smollm2_94a4d22.json",
             "": "weight_sync_h200_smollm2_664443b.json"},
}
# A standalone engine section with one concurrency gives the step there; its growth per row is
# taken from this run's standalone section (the SmolLM2 shape on an H200, 64 and 128 rows).
DECODE_SHAPE_FROM = "async_vs_sync_h200_smollm2_steps.json"


@dataclasses.dataclass(frozen=True)
class Standalone:
    """A setup's parts measured alone, before the run: what a user has."""

    decode_base_s: float
    """Decode step at no rows: the line through the standalone engine's steps at two
    concurrencies (launch + wait + post seconds over its decode steps)."""
    decode_per_row_s: float
    prefill_per_seq_s: float
    """The standalone engine's prefill seconds over the sequences it prefilled (fewest rows)."""
    engine_tokens_per_s: dict[str, float]
    """Per policy, the standalone engine's tokens/s at its concurrency (the naive predictor's)."""
    train_s_per_token: float
    """The standalone trainer's mean step over the tokens of its step (prompt + response)."""
    push_s: float
    push_paused_s: float
    push_encode_s: float
    response_len_mean: float
    """The throw-away run's mean response length (a sync run before the timed ones)."""
    prompt_len: float
    sources: dict[str, str]


def _decode_steps(section: dict[str, Any]) -> dict[int, float]:
    """A ``standalone`` section's engine: concurrency -> its decode step (launch + wait + post)."""
    return {int(k): sum(v["timing_s"][f"decode_{p}_s"] for p in ("launch", "wait", "post"))
            / v["timing_s"]["num_decode_steps"] for k, v in section["engine"].items()}


def _line(points: dict[int, float]) -> tuple[float, float]:
    """(step at no rows, growth per row) through the fewest and the most rows measured; one
    point: its growth per row as a share of the step from ``DECODE_SHAPE_FROM``."""
    (b1, s1), (b2, s2) = sorted(points.items())[0], sorted(points.items())[-1]
    if b1 == b2:
        base, per_row = _line(_decode_steps(_load(DECODE_SHAPE_FROM)["standalone"]))
        share = per_row * b1 / (base + per_row * b1)
        return s1 * (1 - share), s1 * share / b1
    per_row = (s2 - s1) / (b2 - b1)
    return s1 - per_row * b1, per_row


def _push(spec: RunSpec, run: dict[str, Any]) -> tuple[float, float, float, str]:
    """(push, paused, encode) seconds and the file: bench.weight_sync's full push, CUDA IPC."""
    files = PUSH_FILES[_gpu(spec)]
    name = next((f for code, f in files.items() if code and code in spec.file), files[""])
    d = json.loads(kept(name).read_text())["runs"][0]["transports"]["cuda_ipc"]["full"]
    return (d["push_ms_median"] / 1e3, d["paused_ms_median"] / 1e3, d["component_min_ms"]["encode"] / 1e3, name)


def standalone_figures(spec: RunSpec, run: dict[str, Any]) -> Standalone:
    """The run's setup measured alone (see :class:`Standalone`); no in-loop figure."""
    src = spec.standalone_from or spec.file
    st = _load(src)["standalone"] if spec.standalone_from else run["standalone"]
    base, per_row = _line(_decode_steps(st))
    fewest = st["engine"][str(min(int(k) for k in st["engine"]))]
    lengths_src = spec.lengths_from or src
    lengths = _load(lengths_src)["standalone"] if spec.lengths_from else st
    if lengths["response_tokens_from"] != "the throw-away run's mean":
        raise ValueError(f"{lengths_src}: its standalone response length is {lengths['response_tokens_from']!r}, "
                         "not a throw-away run's mean: name a run of the same setup in lengths_from")
    train_s_per_token, trainer_src = _trainer(spec, st, src)
    push, paused, encode, push_file = _push(spec, run)
    conc = {pol: concurrency(run, pol) for pol in run["policies"]}
    return Standalone(
        decode_base_s=base, decode_per_row_s=per_row,
        prefill_per_seq_s=fewest["timing_s"]["prefill_s"] / fewest["concurrency"],
        engine_tokens_per_s={pol: _tokens_per_s(st, c) for pol, c in conc.items()},
        train_s_per_token=train_s_per_token,
        push_s=push, push_paused_s=paused, push_encode_s=encode,
        response_len_mean=float(lengths["response_tokens"]), prompt_len=float(st["prompt_tokens"]),
        sources={"engine": f"{src} standalone.engine", "trainer": trainer_src,
                 "push": f"{push_file} (cuda_ipc, full push median)",
                 "response_len_mean": f"{lengths_src} standalone.response_tokens"})


def _trainer(spec: RunSpec, st: dict[str, Any], src: str) -> tuple[float, str]:
    """Seconds a trained token (prompt or response) on the standalone trainer: the median step
    over the tokens of its step."""
    if spec.trainer_from:
        d = json.loads(kept(spec.trainer_from).read_text())
        (backend, b), = d["backends"].items()
        step_ms = sorted(b["step_ms"])[len(b["step_ms"]) // 2]
        return step_ms / 1e3 / (d["batch"]["samples"] * d["batch"]["tokens_mean"]), f"{spec.trainer_from} ({backend})"
    tr = st["trainer"]
    return (tr.get("step_ms_median") or tr["step_ms"]) / 1e3 / tr["tokens_per_step"], f"{src} standalone.trainer"


def _tokens_per_s(st: dict[str, Any], concurrency: int) -> float:
    """The standalone engine's tokens/s at the concurrency nearest ``concurrency``."""
    near = min(st["engine"], key=lambda k: abs(int(k) - concurrency))
    return float(st["engine"][near]["tokens_per_s"])


def _max_num_seqs(run: dict[str, Any]) -> int:
    return int(_override(run, "rollout.engine.max_num_seqs") or ENGINE_MAX_NUM_SEQS)


def concurrency(run: dict[str, Any], policy: str) -> int:
    """Sequences the engine runs at once (as ``bench.pipeline_report`` sets its standalone
    engine): ``max_num_seqs`` or the samples the policy keeps in flight, whichever is fewer."""
    b = int(run["batch_size"])
    ahead = b if policy == "sync" else math.ceil((1.0 + float(run.get("staleness_threshold", 1.0))) * b)
    return min(_max_num_seqs(run), ahead)


# ---------------------------------------------------------------------------------------------
# The interference model: the loop's parts against their standalone figures
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RuntimeLoop:
    """What the loop adds around the engine's steps, per runtime (``process``: rollout and
    trainer in two processes; ``local``: one process, one GIL)."""

    prefill: dict[str, float]
    """Per schedule: a prefill per sequence over the standalone engine's (sequences arrive a
    group at a time in the loop, all at once in the bench)."""
    push: dict[str, float]
    """Per schedule: a push over bench.weight_sync's median push."""
    sample_overhead_s: float
    """The engine thread's time per sequence outside its counted steps (sync)."""
    driver_overhead_s: float
    """The step's time outside the engine's turns, the train step and the push (sync)."""


@dataclasses.dataclass(frozen=True)
class EraLoop:
    """How rollout and trainer slow each other on one GPU, per code era (``RunSpec.era``)."""

    engine_beside: float
    """Fully-async: a decode step in the loop over ``max(floor, standalone line at its rows)``,
    the mean over the seeds. One factor whether or not a train step is in flight: in the kept
    runs the ratio does not follow the trainer's busy share (1.6-2.3 at shares of 0.4-0.8)."""
    trainer_alone: float
    """Sync: a train step in the loop over the standalone step at the same tokens."""
    trainer_shared: float
    """Fully-async: the same beside a generating engine (its ratio less the engine's idle share
    at ``trainer_alone``, over the engine's busy share)."""


@dataclasses.dataclass(frozen=True)
class Loop:
    """The kept interference model (``bench/results/simulate/simulate_interference.json``): the decode
    step's floor, the factors per code era, the loop's other costs per runtime."""

    decode_floor_s: float
    """Sync: the decode step in the loop (it decodes few rows: the standalone line is below it
    there; a step's host work sets it), the mean over the seeds."""
    era: dict[str, EraLoop]
    runtime: dict[str, RuntimeLoop]

    def to_json(self) -> dict[str, Any]:
        return {"decode_floor_s": self.decode_floor_s,
                "era": {k: dataclasses.asdict(v) for k, v in self.era.items()},
                "runtime": {k: dataclasses.asdict(v) for k, v in self.runtime.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Loop:
        return cls(float(d["decode_floor_s"]), {k: EraLoop(**v) for k, v in d["era"].items()},
                   {k: RuntimeLoop(**v) for k, v in d["runtime"].items()})

    def interference(self, spec: RunSpec, policy: str) -> Interference:
        """Sync: the engine at the floor and its standalone line, the trainer alone. Fully-async:
        the engine beside a running trainer, the trainer beside a generating engine."""
        e = self.era[spec.era]
        beside = 1.0 if _kind(policy) == "sync" else e.engine_beside
        return Interference(decode_floor_s=self.decode_floor_s, engine_alone=beside, engine_shared=beside,
                            trainer_alone=e.trainer_alone, trainer_shared=e.trainer_shared)


def _kind(policy: str) -> str:
    return "sync" if policy in ("sync", "one_step_off") else "fully_async"


def _in_loop(run: dict[str, Any], s: dict[str, Any], sa: Standalone) -> dict[str, float | None]:
    """One seed's in-loop clocks set against its standalone figures (calibration runs only)."""
    e, steps = s["engine"], int(run["steps"])
    decode = sum(e[f"decode_{p}_s"] for p in ("launch", "wait", "post"))
    tokens = int(run["batch_size"]) * (sa.prompt_len + float(s["response_len_mean"]))
    push_s = s["sync_parts_ms_mean"]["total"] / 1e3
    turns = "turn_s" in e  # the engine thread's turns, where its code counted them
    return {
        "decode_step_s": decode / e["num_decode_steps"],
        "decode_rows": e["num_generated_tokens"] / e["num_decode_steps"],
        "line_s": sa.decode_base_s + sa.decode_per_row_s * e["num_generated_tokens"] / e["num_decode_steps"],
        "prefill": e["prefill_s"] / e["num_prefill_seqs"] / sa.prefill_per_seq_s,
        "trainer": s["train_step_ms_mean"] / 1e3 / (sa.train_s_per_token * tokens),
        "push": push_s / sa.push_s,
        "trainer_busy": 1.0 - s["trainer_idle_ratio"],
        "engine_busy": s["engine_busy_ratio"],
        "uncounted_per_seq_s": (e["turn_s"] - decode - e["prefill_s"]) / e["num_prefill_seqs"] if turns else None,
        "driver_s": (s["wall_s"] - e["turn_s"]) / steps - s["train_step_ms_mean"] / 1e3 - push_s if turns else None,
    }


def fit_loop(specs: list[RunSpec]) -> tuple[Loop, dict[str, dict[str, Any]]]:
    """The interference model from the calibration runs' in-loop clocks against their standalone
    figures (the floor over all of them, each era's factors over its runs, each runtime's costs
    over its runs); and, per run and policy, the mean of each figure over its seeds."""
    runs = {s.file: _load(s.file) for s in specs}
    clocks = {s.file: {pol: [_in_loop(runs[s.file], seed, standalone_figures(s, runs[s.file]))
                             for seed in _seeds(runs[s.file]["policies"][pol])] for pol in ("sync", "fully_async")}
              for s in specs}
    floor = _mean([c["decode_step_s"] for pols in clocks.values() for c in pols["sync"]])

    def mean_of(key: str, pol: str, files: list[str]) -> float:
        """Over the seeds that count it (None: a clock the run's code did not keep)."""
        return _mean([v for f in files for c in clocks[f][pol] if (v := c[key]) is not None])

    def era(files: list[str]) -> EraLoop:
        alone = mean_of("trainer", "sync", files)
        fa = [c for f in files for c in clocks[f]["fully_async"]]
        return EraLoop(engine_beside=_mean([c["decode_step_s"] / max(floor, c["line_s"]) for c in fa]),
                       trainer_alone=alone,
                       trainer_shared=_mean([(c["trainer"] - alone * (1 - c["engine_busy"])) / c["engine_busy"]
                                             for c in fa]))

    def runtime(files: list[str]) -> RuntimeLoop:
        return RuntimeLoop(prefill={k: mean_of("prefill", k, files) for k in ("sync", "fully_async")},
                           push={k: mean_of("push", k, files) for k in ("sync", "fully_async")},
                           sample_overhead_s=mean_of("uncounted_per_seq_s", "sync", files),
                           driver_overhead_s=max(0.0, mean_of("driver_s", "sync", files)))

    eras = {e: [s.file for s in specs if s.era == e] for e in sorted({s.era for s in specs})}
    rts = {rt: [f for f, r in runs.items() if r["runtime"] == rt]
           for rt in sorted({r["runtime"] for r in runs.values()})}
    loop = Loop(floor, {e: era(f) for e, f in eras.items()}, {rt: runtime(f) for rt, f in rts.items()})
    per_run = {f: {pol: {k: _mean(vs) if (vs := [c[k] for c in cs if c[k] is not None]) else None for k in cs[0]}
                   for pol, cs in pols.items()} for f, pols in clocks.items()}
    return loop, per_run


# ---------------------------------------------------------------------------------------------
# Predictions
# ---------------------------------------------------------------------------------------------

def _group_size(run: dict[str, Any]) -> int:
    """Samples a prompt (``--n``): the run's batch over its prompts (``--batch-prompts``, default 8)."""
    return int(run["batch_size"]) // int(_flag(run, "--batch-prompts") or 8)


def _eval_overlap(run: dict[str, Any], spec: RunSpec) -> int | None:
    if spec.era == "before":
        return None
    o = _override(run, "policy.eval_overlap_steps")
    return int(o) if o is not None else EVAL_OVERLAP_DEFAULT


def schedule_of(run: dict[str, Any], policy: str, spec: RunSpec) -> Schedule:
    """The run's policy; SmolLM2 runs keep in-flight samples at a push (``sync.in_flight`` auto)."""
    overlap = _eval_overlap(run, spec) if run.get("eval_every") else None
    if policy == "sync":
        return Schedule("sync", eval_overlap_steps=overlap)
    return Schedule("fully_async", staleness_threshold=float(run.get("staleness_threshold", 1.0)),
                    max_staleness=int(run.get("max_staleness", 2)), in_flight="keep", eval_overlap_steps=overlap)


def inputs_for(spec: RunSpec, run: dict[str, Any], sa: Standalone, loop: Loop, policy: str) -> Inputs:
    """The model's inputs: standalone figures, the run's configuration, the interference model."""
    e, kind = loop.runtime[run["runtime"]], _kind(policy)
    cap = int(run["max_response_tokens"])
    return Inputs(decode_base_s=sa.decode_base_s, decode_per_seq_s=sa.decode_per_row_s, prefill_per_token_s=0.0,
                  prefill_per_seq_s=sa.prefill_per_seq_s * e.prefill[kind], train_fixed_s=0.0,
                  train_per_token_s=sa.train_s_per_token, push_s=sa.push_s * e.push[kind],
                  push_paused_s=sa.push_paused_s * e.push[kind], push_encode_s=sa.push_encode_s * e.push[kind],
                  lengths=LengthDist.geometric(min(sa.response_len_mean, cap), cap),
                  prompt_len=round(sa.prompt_len), samples_per_step=int(run["batch_size"]),
                  group_size=_group_size(run), step_overhead_s=e.driver_overhead_s,
                  max_running=_max_num_seqs(run), sample_overhead_s=e.sample_overhead_s,
                  eval_every=int(run.get("eval_every") or 0), eval_samples=int(run.get("eval_prompts") or 0),
                  eval_in_wall=bool(run.get("eval_in_window", True)), interference=loop.interference(spec, policy))


def predict(spec: RunSpec, run: dict[str, Any], sa: Standalone, loop: Loop, policy: str) -> float:
    """Trained tokens/s, the mean over the simulation seeds."""
    inp, sched = inputs_for(spec, run, sa, loop, policy), schedule_of(run, policy, spec)
    steps, warmup = int(run["steps"]), int(run.get("warmup_steps") or 0)
    return _mean([simulate(inp, sched, num_steps=steps, seed=SEED + i, warmup_steps=warmup).trained_tokens_per_s
                  for i in range(NUM_SEEDS)])


def naive(spec: RunSpec, run: dict[str, Any], sa: Standalone, loop: Loop, policy: str) -> float:
    """Trained tokens/s with no schedule: a step's engine time (its samples' tokens at the
    standalone engine's tokens/s at the policy's concurrency, a step at least the floor),
    trainer time and push time from the same inputs, each slowed by the interference model;
    sync adds the three, fully-async takes the larger of engine and trainer."""
    f, b, length = loop.interference(spec, policy), int(run["batch_size"]), sa.response_len_mean
    rows = concurrency(run, policy)
    step = max(f.decode_floor_s, rows / sa.engine_tokens_per_s[policy])
    engine_s = b * length / rows * step * (f.engine_alone if policy == "sync" else f.engine_shared)
    train_s = sa.train_s_per_token * b * (sa.prompt_len + length)
    if policy == "sync":
        push_s = sa.push_s * loop.runtime[run["runtime"]].push["sync"]
        return b * length / (engine_s + train_s * f.trainer_alone + push_s)
    return b * length / max(engine_s, train_s * f.trainer_shared)


# ---------------------------------------------------------------------------------------------
# The kept runs: calibration, validation, left out
# ---------------------------------------------------------------------------------------------

_KNOBS = dict(era="before", standalone_from="async_vs_sync_h200_smollm2_knobs.json#A",
              lengths_from="async_vs_sync_h200_smollm2_steps.json",
              why="the knobs runs' lease and code: run A's standalone section (the engine at 128 rows, the "
                  "trainer); no throw-away run, so the step-by-step run's mean response length (same model, task, cap)")

# The earliest kept run of each machine, runtime and code era that ran both policies with a
# standalone section; their in-loop clocks fit the interference model, and they are not validated.
CALIBRATION = [
    RunSpec("async_vs_sync_h100_smollm2_graphs.json", why="H100, process runtime, code from bb7c3cf (cd64b15)"),
    RunSpec("async_vs_sync_h100_smollm2_graphs_local.json", why="H100, local runtime (cd64b15, the same lease)"),
    RunSpec("async_vs_sync_h200_smollm2_eval_beside.json", why="H200, process runtime, code from bb7c3cf (c40a244)"),
    RunSpec("async_vs_sync_h200_smollm2_steps.json", era="before",
            why="H200, process runtime, code before bb7c3cf (d6e1fec): the trainer waited for evaluations"),
]

VALIDATE = [
    *(RunSpec(f"async_vs_sync_h100_smollm2_{n}.json") for n in (
        "1c5d2f3", "ca68ec2", "fused_head_d73e3e9", "graphs_mps", "mps_1c5d2f3", "mps_2faf9d6", "mps_sm70_2dd85bc",
        "overlap5_2dd85bc", "staleness6_7ec1f3f", "staleness6_ca68ec2", "staleness6_evalend_7ec1f3f",
        "staleness6_overlap7_ca68ec2", "staleness6_warm10_41990f0", "staleness6_warm10_evalend_41990f0")),
    RunSpec("async_vs_sync_h100_smollm2_2dd85bc.json", trainer_from="trainer_step_h100_smollm2_64_2dd85bc.json",
            why="trainer: its standalone section's repeats caught graph captures (185.6, 98.2, 185.7 ms); "
                "bench.trainer_step on the same lease and code measured 86.0-87.9 ms at 64 samples"),
    RunSpec("async_vs_sync_h200_smollm2_664443b.json"),
    RunSpec("async_vs_sync_h200_smollm2_mps.json", lengths_from="async_vs_sync_h200_smollm2_eval_beside.json",
            why="no throw-away run: the mean response length of the same lease's paired run (c40a244)"),
    *(RunSpec(f"async_vs_sync_h200_smollm2_knobs.json#{k}", **_KNOBS) for k in "ABCD"),
]

_NO_STANDALONE_402M = ("402M (Qwen2.5-0.5B body, SmolLM2 tokenizer) on text_arithmetic: no standalone engine "
                       "figure of this model (engine_h200*.json time the 0.5B shape, a 151,936-token head, on other "
                       "code) and no standalone response length (the SFT warm start's answers); its code predates "
                       "the bench's standalone section")
EXCLUDED = {
    "async_vs_sync_h200_text.json": _NO_STANDALONE_402M,
    "async_vs_sync_h200_text_plan_rebuilt.json": _NO_STANDALONE_402M,
    "async_vs_sync_h200_text_v3.json": _NO_STANDALONE_402M,
    "async_vs_sync_h200_text_v4_tail.json": _NO_STANDALONE_402M,
    "async_vs_sync_h200_text_v5_tail_mb16k.json": _NO_STANDALONE_402M,
    "async_vs_sync_h200_text_v6_fair.json": _NO_STANDALONE_402M,
    "h200_trainer_and_length_probe.json": "the 402M probe (16-token responses): " + _NO_STANDALONE_402M,
    "async_vs_sync_h200_smollm2_fair.json": "SmolLM2 at a 64-token cap without the step-by-step instruction "
                                            "(725122d): no standalone section and no standalone figure of that "
                                            "setup kept (engine, trainer or response length)",
    "async_vs_sync_h200.json": "the 397k built-in model on long_tail_copy: no standalone engine or trainer figure "
                               "of it on an H200, and no standalone response length (random weights stop at "
                               "their own rate)",
    "async_vs_sync_h200_diag.json": "the same 397k setup: no standalone figure of it",
    "async_vs_sync_h200_process.json": "the same 397k setup: no standalone figure of it",
    "async_vs_sync_h200_process_overlap.json": "the same 397k setup: no standalone figure of it",
    "async_vs_sync_h200_free_kv.json": "the same 397k setup: no standalone figure of it (and no engine counters)",
    "async_vs_sync_h200_direct.json": "358M random weights on long_tail_copy: no standalone engine figure of it (the "
                                      "0.5B shape's have another head) and no standalone response length",
    "async_vs_sync_h200_main_partial.txt": "no JSON: the log of an unfinished run",
    "async_vs_sync_cpu.json": "a CPU run (the goal is the GPU runs): no standalone section",
    "async_vs_sync_cpu_direct.json": "a CPU run: no standalone section",
    "async_vs_sync_cpu_ray.json": "a CPU run: no standalone section",
    "async_vs_sync_cpu_workers.json": "a CPU run: no standalone section",
    "clean_clone_e91d83a/async_vs_sync_cpu.json": "a CPU run: no standalone section",
    "async_vs_sync_cpu_7c1e492.json": "a CPU run with a standalone section, the only one: a CPU interference model "
                                      "would be calibrated on it, leaving none to validate",
}


FIT = {
    "decode_floor_s": "sync seeds: the engine's decode seconds (launch + wait + post) over its decode steps; the "
                      "mean (sync decodes ~25 rows, where the standalone line is below the loop's step)",
    "engine_beside": "fully-async seeds of the era: the decode step over max(floor, the standalone line at the "
                     "seed's mean rows); the mean",
    "trainer_alone": "sync seeds of the era: train_step_ms_mean over the standalone step at the seed's tokens; "
                     "the mean",
    "trainer_shared": "fully-async seeds of the era: (that ratio - trainer_alone x (1 - engine_busy_ratio)) / "
                      "engine_busy_ratio; the mean",
    "prefill": "seeds of the runtime, per schedule: engine.prefill_s / num_prefill_seqs over the standalone "
               "engine's prefill per sequence; the mean",
    "push": "seeds of the runtime, per schedule: sync_parts_ms_mean.total over bench.weight_sync's median push",
    "sample_overhead_s": "sync seeds of the runtime: (engine.turn_s - decode - prefill seconds) / num_prefill_seqs",
    "driver_overhead_s": "sync seeds of the runtime: (wall_s - engine.turn_s) / steps - train step - push",
}


def calibrate() -> dict[str, Any]:
    """The interference model fit on ``CALIBRATION``, as kept in ``INTERFERENCE_FILE``."""
    loop, per_run = fit_loop(CALIBRATION)
    return {"bench": "simulate --calibrate", "what": " ".join(Loop.__doc__.split()),
            "fit_on": {s.file: s.why for s in CALIBRATION}, "how": FIT, "model": loop.to_json(),
            "per_run": per_run}


def load_loop(path: Path = INTERFERENCE_FILE) -> Loop:
    return Loop.from_json(json.loads(path.read_text())["model"])


# ---------------------------------------------------------------------------------------------
# --validate
# ---------------------------------------------------------------------------------------------

def _row(spec: RunSpec, loop: Loop) -> dict[str, Any]:
    """One run: each policy's measured, predicted and naive trained tokens/s and errors."""
    run = _load(spec.file)
    sa = standalone_figures(spec, run)
    row: dict[str, Any] = {"run": spec.file, "gpu": _gpu(spec), "runtime": run["runtime"], "era": spec.era,
                           "standalone": sa.sources, "recorded_where": spec.why or "the JSON", "policies": {}}
    for policy, p in run["policies"].items():
        m, pred, nv = measured(p), predict(spec, run, sa, loop, policy), naive(spec, run, sa, loop, policy)
        row["policies"][policy] = {"measured_tokens_per_s": round(m, 1), "predicted_tokens_per_s": round(pred, 1),
                                   "naive_tokens_per_s": round(nv, 1), "error": round((pred - m) / m, 3),
                                   "naive_error": round((nv - m) / m, 3)}
    return row


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    preds = [(r["run"], pol, p) for r in rows for pol, p in r["policies"].items()]

    def stats(key: str) -> dict[str, Any]:
        errs = [abs(p[key]) for _, _, p in preds]
        return {"max_abs_error": max(errs), "mean_abs_error": round(_mean(errs), 3),
                "within_25pct": sum(e <= GOAL for e in errs)}

    sim, nv = stats("error"), stats("naive_error")
    return {"runs": len(rows), "predictions": len(preds), "simulator": sim, "naive": nv,
            "within_25pct": sim["within_25pct"] == len(preds),
            "lower_mean_error_than_naive": sim["mean_abs_error"] < nv["mean_abs_error"],
            "misses": [f"{run} {pol}: {p['error']:+.1%}" for run, pol, p in preds if abs(p["error"]) > GOAL]}


def validate(machine: str, loop: Loop | None = None) -> dict[str, Any]:
    """Every kept H100 and H200 run of ``VALIDATE`` predicted from standalone figures and the kept
    interference model; the calibration runs beside them (in-sample, not counted)."""
    loop = loop or load_loop()
    rows = [_row(s, loop) for s in VALIDATE]
    summary = _summary(rows)
    return {
        "bench": "simulate --validate", "machine": machine,
        "method": " ".join(__doc__.split("\n\n")[2].split()),
        "goal": f"every kept GPU run within {GOAL:.0%} of its measured trained tokens/s, and a lower mean error "
                "than the naive predictor on the same runs",
        "goal_met": summary["within_25pct"] and summary["lower_mean_error_than_naive"],
        "summary": summary,
        "interference_model": {"file": str(INTERFERENCE_FILE.relative_to(RESULTS.parent.parent)),
                               "fit_on": [s.file for s in CALIBRATION], "model": loop.to_json()},
        "naive": " ".join(naive.__doc__.split()),
        "runs": rows,
        "calibration_runs": {"role": "the interference model was fit on their in-loop clocks: in-sample, not counted",
                             "runs": [_row(s, loop) for s in CALIBRATION]},
        "excluded": EXCLUDED,
    }
