"""The pipeline report of ``bench.async_vs_sync`` (issue 29): how close each
policy's loop comes to what its parts do alone.

Before the timed runs, :func:`standalone` measures the parts alone, in the
bench's own process, on the runs' model and config:

- the engine (``bench.engine.bench_engine``: the built-in engine, fixed-length
  sampled responses, prefill included) at each policy's concurrency
  (:func:`engine_concurrency`: ``rollout.engine.max_num_seqs`` or the samples
  the policy keeps in flight, whichever is fewer) with responses of the
  runs' length (the throw-away run's mean, or ``--standalone-response-tokens``);
- the trainer (``bench.trainer_step``'s synthetic batches, timed as it times
  them) on the runs' batch shape: ``trainer.batch_prompts`` groups of
  ``rollout.n`` samples, the task's mean prompt length, that response length.

Then, per run, :func:`in_loop` reads the same figures off the loop (the
engines' ``statistics()`` counters through the rollout actors, the step
records) and :func:`efficiency` sets them against the standalone ones. The
field names and their meaning are in :data:`FIELDS`, which the JSON carries.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import loop

#: Every field this module adds to a run's report, and what it means (written into the JSON).
FIELDS = {
    "engine_tokens_per_s": "rollout tokens the engines generated in the timed window over its wall time (the "
                           "built-in engine's num_generated_tokens, evaluations included; for others, estimated: samples "
                           "the rollout actors finished in it (their statistics' num_generated) x the mean "
                           "trained response length, plus the in-window evaluations' response tokens)",
    "rollout_tokens_in_window": "engine_tokens_per_s's tokens less the in-window evaluations' response "
                                "tokens: what the window generated for training",
    "backlog_share": "share of the window's trained response tokens the window did not generate: "
                     "max(0, trained - rollout_tokens_in_window) / trained, drawn from samples generated before "
                     "it opened (a fully-async window that opens on a full queue trains them; sync: 0)",
    "sustained_tokens_per_s": "min(trained, rollout_tokens_in_window) response tokens over the window's wall "
                              "time: the trained tokens/s the window's own generation sustains (over a long run "
                              "trained tokens cannot outrun generated ones)",
    "engine_busy_ratio": "share of the window the engines spent in prefill or decode steps (their statistics' "
                         "prefill_s + decode_*_s, summed over engines)",
    "engine_decode_rows_mean": "tokens per decode step in the window (the loop's decode batch)",
    "engine_thread_cpu_share": "CPU seconds the built-in engine's thread used in the window over its wall time, "
                               "per engine (its Python and launches: the host side of its steps)",
    "rollout_loop_cpu_share": "the same for the thread that runs the rollout actor's event loop (scoring, "
                              "queue puts, calls; it takes the GIL from the engine's thread; under the local "
                              "runtime the driver's loop, shared with everything else)",
    "rollout_process_cpu_share": "the same for the rollout actor's whole process (every thread)",
    "engine_offcpu_share": "share of the built-in engine thread's turns (admission, prefill, decode, posting) "
                           "it spent off the CPU: (turn_s - thread_cpu_s) / turn_s. Waits for the device spin "
                           "on the CPU, so what is left is waiting for the GIL (the loop's and other threads' "
                           "Python) or for a core; the standalone engine's own is beside it "
                           "(engine_standalone_offcpu_share)",
    "samples_admitted_mean": "fully-async: samples admitted and not yet trained (its admission window's "
                             "count), averaged over the window's probes (at its start, then every 50 ms); the "
                             "next four split the policy's samples by where they are",
    "samples_in_engine_mean": "in the engines: decoding or waiting for a slot (their num_running + num_waiting; "
                              "running counts rows that ended at the step in flight too)",
    "samples_finished_in_rollout_mean": "in the rollout actors, finished, waiting for the rest of their group "
                                        "(or being scored)",
    "samples_queued_mean": "in the TransferQueue, not yet taken by the trainer",
    "samples_in_trainer_mean": "taken by the trainer, not yet acknowledged (its step)",
    "rollout_gc_share": "share of the window the rollout actor's process spent in garbage collections (each "
                        "holds the GIL: the engine's thread stands still; actors/gc_clock.py)",
    "engine_concurrency": "sequences the engine may run at once for this policy: min(max_num_seqs, in-flight "
                          "samples per engine); the standalone engine ran at it",
    "engine_standalone_tokens_per_s": "the standalone engine's tokens/s at engine_concurrency (x engines)",
    "engine_in_loop_over_standalone": "engine_tokens_per_s / engine_standalone_tokens_per_s",
    "engine_standalone_offcpu_share": "engine_offcpu_share of the standalone engine's timed batch",
    "engine_turn_us": "the built-in engine's mean turn in the window, microseconds by part: host (its Python "
                      "between the calls), forward and sample (the model's and the sampler's calls: compute on a "
                      "CPU, launches on CUDA), device_wait; engine_standalone_turn_us: the standalone engine's",
    "trainer_step_ms_median": "median trainer step in the run (a record's train_s: batch in hand to weights "
                              "stepped)",
    "trainer_mfu": "mean model FLOPs utilisation of the run's trainer steps (train/mfu; null where the "
                   "device's peak is not known: CPUs, set trainer.peak_tflops)",
    "trainer_standalone_step_ms": "the standalone trainer's mean step over 8 synthetic batches of the run's "
                                  "shape (the runs kept before this field said so: the median of 3), scaled "
                                  "linearly to the run's mean tokens per step",
    "trainer_in_loop_over_standalone": "trainer_step_ms_median / the standalone trainer's median step, scaled "
                                       "the same way (> 1: slower in the loop)",
    "sync_total_ms_median": "median whole weight sync of the timed steps (sync/total_ms); _max: the slowest",
    "sync_paused_ms_median": "median time the engines stood still per sync (sync/paused_ms); _max: the longest",
    "startup_s": "seconds from the start of the run's construction to its first trained step; startup: its "
                 "phases (Run.startup: config, task, runtime, queue, actors, weight_link, policy, "
                 "before_train, initial_eval, first_step), disjoint, so they sum to at most startup_s",
    "step_s": "wall time per timed step (wall_s / steps)",
    "engine_bound_step_s": "samples per step x mean response tokens / engine_standalone_tokens_per_s",
    "trainer_bound_step_s": "trainer_standalone_step_ms / 1000",
    "pipeline_efficiency": "max(engine_bound_step_s, trainer_bound_step_s) / step_s: the step time the slower "
                           "part alone would allow over the one reached (1: a perfect pipeline; a serial "
                           "schedule gets at most the slower part's share of the sum)",
    "pipeline_bound_by": "which part is slower alone: engine or trainer",
}


def in_flight_samples(cfg: Any) -> int:
    """Samples the policy keeps generating at once: one batch for the baselines,
    the admission window for fully-async (``policies.admission.window_budget``)."""
    from policies.admission import window_budget

    p = cfg.policy
    if p.type != "fully_async":
        return cfg.batch_size * p.require_batches
    return window_budget(cfg.batch_size, p.require_batches, p.trigger_parameter_sync_step, p.staleness_threshold)


def engine_concurrency(cfg: Any) -> int:
    """Sequences one engine may run at once for this config's policy (a built-in engine on
    CUDA sized from free memory, ``max_num_seqs: null``: at most ``CUDA_MAX_NUM_SEQS``)."""
    from actors.engines.config import CUDA_MAX_NUM_SEQS

    per_engine = math.ceil(in_flight_samples(cfg) / cfg.rollout.num_actors)
    return min(cfg.rollout.engine.max_num_seqs or CUDA_MAX_NUM_SEQS, per_engine)


def prompt_tokens_mean(cfg: Any, model_path: str, n: int = 64) -> float:
    """Mean prompt length of the task's training prompts (``n`` drawn)."""
    from policies.tasks import make_task

    task = make_task(cfg.task.type, model_path=model_path, **cfg.task.kwargs)
    prompts = task.sample_prompts(random.Random(0), n)
    return statistics.fmean(len(p.prompt_ids) for p in prompts)


@contextlib.contextmanager
def _cpu_threads(device: str) -> Iterator[None]:
    """On CPU, one torch thread while measuring, as each actor has (``torch_threads=1``)."""
    import torch

    kept = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(kept)


def standalone_engine(cfg: Any, model_path: str, concurrency: int, prompt_tokens: int,
                      response_tokens: int) -> dict[str, Any]:
    """``bench.engine.bench_engine`` on the run's model and engine options:
    ``concurrency`` random prompts of ``prompt_tokens``, ``response_tokens``
    sampled each (no stop token), prefill included."""
    import torch
    import transformers

    from bench.engine import bench_engine

    e = cfg.rollout.engine
    if e.type != "torch":
        raise ValueError(f"rollout.engine.type: the standalone engine measure needs the built-in engine, "
                         f"got {e.type!r} (--no-standalone skips it)")
    vocab = transformers.AutoConfig.from_pretrained(model_path).vocab_size
    g = torch.Generator().manual_seed(concurrency)
    prompts = torch.randint(1, vocab, (concurrency, prompt_tokens), generator=g).tolist()
    with _cpu_threads(e.device):
        out = loop.run(bench_engine(model_path, prompts, response_tokens, e.device, e.dtype, e.cuda_graphs,
                                    micro=False, compile_decode=e.compile_decode))
    return {"concurrency": concurrency, "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
            "tokens_per_s": round(out["tokens_per_s"], 2), "offcpu_share": out["offcpu_share"],
            "turn_us": out["turn_us"],
            "timing_s": out["timing"]}


def standalone_trainer(cfg: Any, model_path: str, prompt_tokens: int, response_tokens: int,
                       steps: int = 8, warmup: int = 1) -> dict[str, Any]:
    """The run's trainer backend (``cfg.trainer``) alone, on ``bench.trainer_step``'s
    synthetic batches of the run's shape: the mean of ``steps`` steps after ``warmup`` (the
    median beside it). A mean over several batches, because steps are bimodal where a batch
    can pass ``trainer.micro_batch_tokens``: a split step's leftover micro-batch may run in
    a full-size graph bucket (185.6, 98.2, 185.7 ms: the median of three at 2dd85bc). A step
    that captured graphs is timed again (:func:`timed_step`; ``captures_retimed``)."""
    import torch
    import transformers

    from actors.backends import make_backend
    from actors.backends.flops import FlopsModel, peak_flops
    from bench.trainer_step import _batch
    from policies.losses import make_loss_from_config

    t = cfg.trainer
    shape = argparse.Namespace(groups=t.batch_prompts, n=cfg.rollout.n, prompt_len=prompt_tokens,
                               response_len=response_tokens)
    vocab = transformers.AutoConfig.from_pretrained(model_path).vocab_size
    rng = random.Random(0)
    batches = [_batch(rng, vocab, shape) for _ in range(max(steps, warmup))]
    adv = [(-1.0) ** i for i in range(len(batches[0]))]
    with _cpu_threads(t.device):
        backend = make_backend(t, model_path, seed=cfg.run.seed, loss=make_loss_from_config(t))
        backend.setup()
        # a graphed trainer captures each batch's padded shape once: before the timed steps
        for i in range(max(warmup, steps) if getattr(backend, "cuda_graphs", False) else warmup):
            backend.train_step(batches[i], adv)
        timed = [timed_step(backend, batch, adv, t.device) for batch in batches[:steps]]
        times, captures = [s for s, _ in timed], sum(c for _, c in timed)
    del backend
    gc.collect()
    if t.device.startswith("cuda"):
        torch.cuda.empty_cache()
    step_s = statistics.fmean(times)
    seq_lens = [len(s.prompt_ids) + len(s.response_ids) for b in batches[:steps] for s in b]
    step_flops = FlopsModel.from_model_dir(model_path).train_flops(seq_lens) / steps
    peak = t.peak_tflops * 1e12 if t.peak_tflops else peak_flops(t.device, t.dtype)
    return {"samples": len(batches[0]), "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
            "tokens_per_step": sum(seq_lens) / steps, "step_ms": round(step_s * 1e3, 3),
            "step_ms_median": round(statistics.median(times) * 1e3, 3),
            "step_ms_repeats": [round(x * 1e3, 3) for x in times], "captures_retimed": captures,
            "tflops": step_flops / step_s / 1e12, "mfu": step_flops / step_s / peak if peak else None}


def timed_step(backend: Any, batch: list[Any], adv: list[float], device: str) -> tuple[float, bool]:
    """Seconds of one ``train_step`` on ``batch``, and whether it captured CUDA graphs. A step
    that captured is timed again: one batch warmed up once may still capture later, when
    the bucket it was padded into has cost its own bucket's capture in padding
    (``actors.backends.graphs.pick_bucket``), and a capture (0.4-0.8 s) is a one-time cost,
    not the step's (an 861 ms repeat among 68-130 ms ones on an H100, d73e3e9)."""
    from bench.trainer_step import _sync

    graphs = getattr(backend, "_graphs", None)

    def once() -> tuple[float, bool]:
        before = graphs.capture_s if graphs is not None else 0.0
        _sync(device)
        t0 = time.perf_counter()
        backend.train_step(batch, adv)
        _sync(device)
        return time.perf_counter() - t0, graphs is not None and graphs.capture_s != before

    seconds, captured = once()
    return (once()[0], True) if captured else (seconds, False)


def standalone(configs: dict[str, Any], model_path: str, response_tokens: int) -> dict[str, Any]:
    """The standalone engine at each distinct concurrency of ``configs`` (policy
    name -> resolved config) and the standalone trainer (their shared batch shape)."""
    from actors.runtime import quiet_transformers

    quiet_transformers()  # no model-loading progress bars in the bench's output
    first = next(iter(configs.values()))
    t0 = time.perf_counter()
    prompt_tokens = round(prompt_tokens_mean(first, model_path))
    conc = {name: engine_concurrency(cfg) for name, cfg in configs.items()}
    engines = {str(c): standalone_engine(first, model_path, c, prompt_tokens, response_tokens)
               for c in sorted(set(conc.values()))}
    trainer = standalone_trainer(first, model_path, prompt_tokens, response_tokens)
    return {"prompt_tokens": prompt_tokens, "response_tokens": response_tokens, "engine_concurrency": conc,
            "num_engines": first.rollout.num_actors, "engine": engines, "trainer": trainer,
            "seconds": round(time.perf_counter() - t0, 2)}


# ---------------------------------------------------------------- the loop's own figures


def engine_counters(stats: list[dict[str, Any]]) -> dict[str, float]:
    """The engines' counters (``RolloutActor.statistics``), summed over rollout actors."""
    keys = ("num_generated", "num_generated_tokens", "num_decode_steps", "num_prefill_seqs", "prefill_s", "decode_launch_s",
            "decode_wait_s", "decode_post_s", "num_turns", "turn_s", "forward_s", "sample_s", "device_wait_s",
            "thread_cpu_s", "loop_cpu_s", "process_cpu_s", "gc_pause_s")
    return {k: float(sum(s.get(k, 0) for s in stats)) for k in keys}


BUDGET_PROBE_S = 0.05  # how often the window's samples are counted by where they are


async def probe_samples(policy: Any, out: list[dict[str, float]]) -> None:
    """At once and then every ``BUDGET_PROBE_S`` until cancelled (so a window of any length
    has a probe), count the policy's samples by where they are (appended to ``out``):
    admitted and not yet trained (fully-async's admission window), in the rollout actors,
    in their engines (running or waiting), queued, in the trainer's hands. One statistics
    call per rollout actor and one to the queue a probe."""
    admission = getattr(policy, "admission", None)
    while True:
        try:
            engines = await asyncio.gather(*(h.statistics() for h in policy.rollouts))
            queue = await policy.queue.statistics_async()
        except Exception:  # noqa: BLE001 - an actor lost mid-window: the run reports that, not the probe
            return
        out.append({"outstanding": admission.carried + admission.admitted_in_window if admission else math.nan,
                    "in_rollout": policy.in_flight,
                    "in_engine": sum(e.get("num_running", 0) + e.get("num_waiting", 0) for e in engines),
                    "queued": queue.pending, "in_trainer": queue.in_flight})
        await asyncio.sleep(BUDGET_PROBE_S)


def where_samples_are(probes: list[dict[str, float]]) -> dict[str, Any]:
    """:func:`probe_samples`' counts, averaged over the window: ``samples_*_mean``."""
    if not probes:
        return {}
    mean = {k: statistics.fmean(p[k] for p in probes) for k in probes[0]}
    return {"samples_admitted_mean": None if math.isnan(mean["outstanding"]) else mean["outstanding"],
            "samples_in_engine_mean": mean["in_engine"],
            "samples_finished_in_rollout_mean": max(0.0, mean["in_rollout"] - mean["in_engine"]),
            "samples_queued_mean": mean["queued"], "samples_in_trainer_mean": mean["in_trainer"],
            "num_probes": len(probes)}


def turn_us(timing: dict[str, float]) -> dict[str, float] | None:
    """Microseconds of the built-in engine's mean turn by part (``engine_turn_us``), from its
    counters: ``host`` (its Python between the calls below), ``forward`` and ``sample`` (the
    model's and the sampler's calls: compute on a CPU, launches on CUDA), ``device_wait``;
    None without turns."""
    turns = timing.get("num_turns")
    if not turns:
        return None
    parts = {k: timing[k + "_s"] for k in ("forward", "sample", "device_wait")}
    return {"host": round((timing["turn_s"] - sum(parts.values())) / turns * 1e6, 1),
            **{k: round(v / turns * 1e6, 1) for k, v in parts.items()}, "num_turns": int(turns)}


def offcpu_share(turn_s: float, thread_cpu_s: float) -> float | None:
    """Share of the engine thread's turns spent off the CPU (``engine_offcpu_share``);
    None without both clocks. Clamped at 0: the thread's CPU clock also runs between turns."""
    if turn_s <= 0 or thread_cpu_s <= 0:
        return None
    return max(0.0, turn_s - thread_cpu_s) / turn_s


def in_loop(hist: list[dict[str, Any]], trained_samples: int, before: dict[str, float], after: dict[str, float],
            wall_s: float, num_engines: int) -> dict[str, Any]:
    """The engine, trainer and sync figures of the timed steps ``hist`` (``trained_samples``
    in them); ``before`` / ``after``: :func:`engine_counters` as the window opened and closed."""
    d = {k: after[k] - before[k] for k in after}
    trained = sum(m["num_tokens"] for m in hist)
    eval_tokens = sum(m.get("eval/response_len_mean", 0.0) * m.get("eval/num_prompts", 0) for m in hist)
    # the built-in engine counts the tokens it generated; others: samples finished x trained length
    tokens = d["num_generated_tokens"] or d["num_generated"] * trained / max(1, trained_samples) + eval_tokens
    busy_s = d["prefill_s"] + d["decode_launch_s"] + d["decode_wait_s"] + d["decode_post_s"]
    syncs = [m for m in hist if "sync/total_ms" in m]
    rollout_tokens = tokens - eval_tokens  # both ways of counting hold the evaluations' tokens
    out: dict[str, Any] = {
        "engine_tokens_in_window": round(tokens, 1),
        "engine_tokens_per_s": tokens / wall_s,
        "rollout_tokens_in_window": round(rollout_tokens, 1),
        "backlog_share": max(0.0, trained - rollout_tokens) / trained if trained else None,
        "sustained_tokens_per_s": min(trained, rollout_tokens) / wall_s,
        "engine_busy_ratio": min(1.0, busy_s / (wall_s * num_engines)),
        "engine_decode_rows_mean": (tokens - d["num_prefill_seqs"]) / d["num_decode_steps"]
        if d["num_decode_steps"] else None,
        "trainer_step_ms_median": 1e3 * statistics.median(m["train_s"] for m in hist),
        "trainer_mfu": statistics.fmean(m["train/mfu"] for m in hist) if "train/mfu" in hist[-1] else None,
        "num_syncs": len(syncs),
    }
    # CPU shares of the window, per rollout actor (absent where its statistics do not carry the clock)
    for key, clock in (("engine_thread_cpu_share", "thread_cpu_s"), ("rollout_loop_cpu_share", "loop_cpu_s"),
                       ("rollout_process_cpu_share", "process_cpu_s"), ("rollout_gc_share", "gc_pause_s")):
        out[key] = d[clock] / (wall_s * num_engines) if d[clock] > 0 else None
    out["engine_offcpu_share"] = offcpu_share(d["turn_s"], d["thread_cpu_s"])
    out["engine_turn_us"] = turn_us(d)
    for key in ("total", "paused"):
        values = [m.get(f"sync/{key}_ms", 0.0) for m in syncs]
        out[f"sync_{key}_ms_median"] = statistics.median(values) if values else None
        out[f"sync_{key}_ms_max"] = max(values) if values else None
    return out


def efficiency(run: dict[str, Any], policy: str, stand: dict[str, Any] | None) -> dict[str, Any]:
    """``run``'s in-loop figures (a run of ``bench.async_vs_sync``, with :func:`in_loop`'s)
    set against the standalone ones (``stand``: :func:`standalone`; None: not measured,
    nothing added)."""
    if not stand or "engine_tokens_per_s" not in run:
        return {}
    conc = stand["engine_concurrency"][policy]
    engine_tps = stand["engine"][str(conc)]["tokens_per_s"] * stand["num_engines"]
    response_tokens = run["response_len_mean"]
    samples_per_step = run["samples_per_s"] / run["steps_per_s"]
    tr = stand["trainer"]
    run_tokens_per_step = samples_per_step * (stand["prompt_tokens"] + response_tokens)
    scale = run_tokens_per_step / tr["tokens_per_step"]
    trainer_ms = tr["step_ms"] * scale
    step_s = 1.0 / run["steps_per_s"]
    engine_bound_s = samples_per_step * response_tokens / engine_tps
    trainer_bound_s = trainer_ms / 1e3
    return {
        "engine_concurrency": conc,
        "engine_standalone_tokens_per_s": engine_tps,
        "engine_in_loop_over_standalone": run["engine_tokens_per_s"] / engine_tps,
        "engine_standalone_offcpu_share": stand["engine"][str(conc)].get("offcpu_share"),
        "engine_standalone_turn_us": stand["engine"][str(conc)].get("turn_us"),
        "trainer_standalone_step_ms": trainer_ms,
        "trainer_standalone_mfu": tr["mfu"],
        "trainer_in_loop_over_standalone":
            run["trainer_step_ms_median"] / (tr.get("step_ms_median", tr["step_ms"]) * scale),
        "step_s": step_s,
        "engine_bound_step_s": engine_bound_s,
        "trainer_bound_step_s": trainer_bound_s,
        "pipeline_efficiency": max(engine_bound_s, trainer_bound_s) / step_s,
        "pipeline_bound_by": "engine" if engine_bound_s >= trainer_bound_s else "trainer",
    }
