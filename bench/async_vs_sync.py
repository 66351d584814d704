"""Fully-async vs synchronous vs one-step-off training, same everything else.

    python -m bench.async_vs_sync                 # CPU, default model, long-tail task, 3 seeds
    python -m bench.async_vs_sync --device cuda   # the same on a GPU
    python -m bench.async_vs_sync --runtime process,local   # each policy under both runtimes: sync cost ratio

Every policy runs the same task, model, engine, trainer, batch size and
number of trainer steps (so the same sample budget), one after the other in
this process, seed by seed (every policy runs seed 0, then seed 1, ...). The
order of the policies rotates from seed to seed (two policies alternate: seed 0
sync then fully_async, seed 1 fully_async then sync), so whatever the machine
does early or late in a seed falls on each policy in turn; the JSON records it
(``policy_order``, and each run's ``seed`` and ``position``).

Warm-up, alike for every policy: each run starts its own actors and takes
``--warmup-steps`` trainer steps untimed (at least one weight sync of every
policy: the flag's minimum is the longest sync interval among the policies),
waits for the last of their pushes, and with ``--eval-prompts`` evaluates once
before them; one-time costs (CUDA context, kernels JIT-compiled or graphs
captured per shape, first use of each prefill shape) land there in whichever
processes the actors live, and every policy is timed in steady state
(fully-async starts the timed window with its pipeline full and ends it with
work in flight alike). Before seed 0, one throw-away run (the first policy, on a
seed outside the timed ones, untimed, ``warmup_run``; ``--no-warmup-run`` skips
it) takes the costs paid once per process or machine (on-disk kernel caches,
the ``local`` runtime's own process) so they land in no timed window.

Prints one JSON object: per policy the wall time of the timed steps (setup
excluded), steps/s, trained tokens/s, samples/s, trainer and rollout idle ratios
and the final reward (mean over the last 10% of steps), each as mean, spread,
min and max over seeds, and the speedup of each policy over sync: from the mean
over seeds of trained tokens/s (the headline, ``speedup_X_over_sync``) and of
steps/s, and seed by seed. ``fully_async`` syncs weights after every trainer
step like the baselines; ``fully_async_k2`` every second step.

The loop against its parts alone (issue 29; ``bench/pipeline_report.py``,
whose ``FIELDS`` the JSON carries as ``pipeline_fields``). Before the timed runs
(after the throw-away run) the bench measures, in its own process, the
built-in engine alone (``bench.engine.bench_engine``) on the runs' model at each
policy's concurrency (``engine_concurrency``: ``rollout.engine.max_num_seqs``
or the samples the policy keeps in flight, one batch for the baselines, the
admission window for fully-async, whichever is fewer) with responses of the
throw-away run's mean length, and the trainer alone (``bench.trainer_step``'s
batches, the runs' ``trainer`` config) on the runs' batch shape: the JSON's
``standalone``. ``--no-standalone`` skips both. Each run then reports:

- ``engine_tokens_per_s``: generated tokens/s of the rollout engines over the
  timed window (samples the rollout actors finished in it, from their
  ``statistics()``, times the mean trained response length, plus in-window
  evaluations' tokens: the engines count samples and steps, not tokens),
  ``engine_busy_ratio`` and ``engine_decode_rows_mean`` from the engines'
  counters, ``engine_standalone_tokens_per_s`` and
  ``engine_in_loop_over_standalone``; the CPU shares of the window of the
  engine's thread, the rollout actor's event-loop thread and its process
  (``engine_thread_cpu_share``, ``rollout_loop_cpu_share``,
  ``rollout_process_cpu_share``) and the share of the engine thread's
  turns it spent off the CPU, waiting for the GIL or a core
  (``engine_offcpu_share``, the standalone engine's beside it);
- ``trainer_step_ms_median`` (a record's ``train_s``) and ``trainer_mfu``
  (``train/mfu``; null where the device's peak is unknown) beside
  ``trainer_standalone_step_ms`` (the mean of 8 steps alone, a step that captured CUDA graphs
  timed again, scaled to the run's tokens per step),
  ``trainer_standalone_mfu`` and ``trainer_in_loop_over_standalone``;
- ``sustained_tokens_per_s``: the smaller of the window's trained response
  tokens and the rollout tokens the window itself generated (the engines'
  count less the in-window evaluations'), over its wall time, and
  ``backlog_share``: the share of its trained tokens it did not generate. A
  fully-async window opens with finished samples waiting (its staleness
  allows up to ``max_staleness`` steps of them) and trains some of them, so
  its trained tokens/s can outrun what its engines sustain over a long run;
  sync's window trains exactly what it generated (``backlog_share`` 0).
  ``speedup_sustained_tokens_per_s_X_over_sync`` sets them side by side;
- ``sync_total_ms_median`` / ``_max`` and ``sync_paused_ms_median`` / ``_max``
  over the timed steps' weight syncs (``num_syncs``);
- ``startup_s``, construction of the run to its first trained step, and
  ``startup``: its phases (``Run.startup``: config, task, runtime, queue,
  trainer, rollout, weight_link, policy, before_train: the bench's first
  evaluation, initial_eval, first_step), which sum to at most it;
- ``pipeline_efficiency``: ``max(engine_bound_step_s, trainer_bound_step_s) /
  step_s``, the step time the slower part alone allows for the same samples
  per step (engine: samples x mean response tokens / standalone tokens/s,
  prefill included; trainer: its standalone step) over the step time reached;
  ``pipeline_bound_by`` names the slower part.

``--step-by-step`` is ``text_arithmetic`` with worked answers (the instruction
``STEP_BY_STEP``, 512 response tokens unless ``--max-response-tokens``).

Learning, at equal trained samples: ``--eval-prompts N`` scores N fixed
held-out prompts of the task (one greedy response each, ``policy.eval_prompts``)
before the first step and after the last, both untimed; ``--eval-every K``
adds evaluations every K trainer steps (``policy.eval_every``), whose time
counts in the timed window (``eval_in_window: true``): fully-async's rollout
keeps generating during them and the baselines' does not, so stopping the
clock would hand fully-async free generation. ``--eval-outside-window`` subtracts
them anyway (the old figures; ``eval_in_window: false``): generation cannot be
paused for them, since the engine that would pause is the one they run on.
Each run reports ``eval_s`` (the in-window evaluations), ``eval_reward_first``,
``eval_reward_last``, ``eval_at_trained`` (samples trained at the last
evaluation: the same for every policy, which all train the same steps of the
same batch) and ``eval_curve`` (``[step, trained, reward]``); ``--eval-every 0``
gives the purest throughput comparison.

A text task on a 402M-parameter model (the Qwen2.5-0.5B body over SmolLM2's
tokenizer), on one GPU. Here, where the converted SmolLM2 checkpoint is (only
its tokenizer travels: a few MB):

    python -m bench.make_model --export-tokenizer models/smollm2-135m-instruct --out models/smollm2-tokenizer

then on the GPU machine (carry ``models/smollm2-tokenizer`` and ``.whl``; no
Ray there, so ``--runtime process``):

    pip install -q --no-index --find-links .whl msgspec pyyaml tqdm
    python -m bench.make_model --out /tmp/q05-smol --tokenizer models/smollm2-tokenizer
    python -m tools.sft_text --model /tmp/q05-smol --task text_arithmetic \
        --task-kwargs '{"digits": 2, "ops": "+"}' --steps 1500 --max-seconds 75 --batch-size 64 \
        --lr 3e-4 --device cuda --dtype bfloat16 --eval-prompts 128
    python -m bench.async_vs_sync --device cuda --runtime process --task text_arithmetic \
        --task-kwargs '{"digits": 2, "ops": "+"}' --policies sync,fully_async --seeds 3 \
        --steps 30 --warmup-steps 2 --batch-prompts 8 --n 8 --max-response-tokens 16 \
        --eval-prompts 128 --eval-every 10 --out $OUT/async_vs_sync_h200_text.json \
        model.path=/tmp/q05-smol trainer.lr=2e-5 trainer.dtype=bfloat16

The warm start prints its held-out ``eval_reward``: it should be above 0 (and
well below 1) for RL's gain to be measurable; if it is 0, give it more steps.
The same sequence with ``make_model --shape tiny --dtype float32``, SFT and the
benchmark on ``--device cpu`` (6.7M parameters, most of them SmolLM2's
embedding), on this project's 2-core CPU: make_model 6 s; SFT 77 s (202 steps
in its 75 s, held-out reward still 0: a CPU-sized model learns this slowly);
one benchmark run (process runtime, 2 + 30 steps of 64 samples, 4
evaluations of 128 prompts) about 220 s with setup, 190 s timed, so the whole
3-seed, 2-policy benchmark about 20 min. ``tests/test_text_bench.py`` runs a
1-seed, 3-step version in a few seconds; ``tests/test_bench_fairness.py`` checks
the order, warm-up and timed-window rules on the built-in 397k model.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import inspect
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import loop
from actors.config import load_config
from actors.launch import launch
from bench import pipeline_report

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Runs are built from YAML overrides: a process runtime's children need nothing defined here.
SPAWN_IMPORTS_MAIN = False
POLICIES = {
    "sync": ["policy.type=sync"],
    "one_step_off": ["policy.type=one_step_off"],
    "fully_async": ["policy.type=fully_async", "rollout.partial_rollout=true"],
    # the same, syncing weights every 2 trainer steps (half the interruptions)
    # (its window already spans two steps, so it runs half as far ahead per step)
    "fully_async_k2": ["policy.type=fully_async", "rollout.partial_rollout=true",
                       "policy.trigger_parameter_sync_step=2", "policy.staleness_threshold=1"],
}


def task_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The task's options: ``--task-max-len`` / ``--tail-alpha`` for the symbol tasks
    whose factory takes them (``long_tail_copy`` both, ``reverse_digits`` max_len),
    then ``--task-kwargs`` (JSON) over them; text tasks get ``--task-kwargs`` alone."""
    from policies.tasks import task_factory

    try:
        params = inspect.signature(task_factory(args.task)).parameters
    except ValueError as exc:
        raise ValueError(f"--task: {exc}") from None
    out: dict[str, Any] = {}
    if "max_len" in params:  # a symbol task (text tasks take max_digits, not max_len)
        out["max_len"] = args.task_max_len
        if "tail_alpha" in params:
            out["tail_alpha"] = args.tail_alpha
    return {**out, **args.task_kwargs}


def max_model_len(args: argparse.Namespace) -> int:
    """``--max-model-len``, or room for the prompt and ``--max-response-tokens``:
    a symbol task's prompt is at most its answer plus 3 tokens; a text task's
    rendered prompt (chat template, system turn) is given 256."""
    if args.max_model_len:
        return args.max_model_len
    kwargs = task_kwargs(args)
    return (kwargs["max_len"] + 16 if "max_len" in kwargs else 256) + args.max_response_tokens


def run_overrides(policy: str, seed: int, runtime: str, args: argparse.Namespace, workers: int = 1) -> list[str]:
    """The config overrides of one run (over ``fully_async.yaml``); ``workers``: trainer actors."""
    overrides = [
        f"run.seed={seed}", f"run.total_steps={args.warmup_steps + args.steps}", "run.progress=false",
        f"run.output_dir={args.output_dir}", f"task.type={args.task}",
        f"rollout.max_response_tokens={args.max_response_tokens}",
        f"rollout.engine.max_model_len={max_model_len(args)}",
        # JSON values are YAML scalars as the override parser reads them ("+-*" stays a string)
        *(f"task.kwargs.{k}={json.dumps(v)}" for k, v in task_kwargs(args).items()),
        f"trainer.batch_prompts={args.batch_prompts}", f"rollout.n={args.n}",
        f"policy.staleness_threshold={args.staleness_threshold}",
        f"policy.max_staleness={args.max_staleness}",
        f"policy.eval_every={args.eval_every}",
        *([f"policy.eval_prompts={args.eval_prompts}"] if args.eval_prompts else []),
        f"runtime.type={runtime}", *POLICIES[policy], *args.overrides,
    ]
    if args.device != "cpu":
        engine_device = "cuda:1" if args.placement == "disaggregated" else args.device
        trainer_device = "cuda:0" if args.placement == "disaggregated" else args.device
        overrides += [f"rollout.engine.device={engine_device}", f"trainer.device={trainer_device}",
                      "rollout.engine.dtype=bfloat16", f"sync.colocated={args.free_kv}"]  # sync.mode: the default
    if workers != 1:
        overrides.append(f"trainer.num_workers={workers}")
    if args.placement == "disaggregated":  # separate processes, weights by broadcast
        overrides += ["sync.colocated=false", "sync.transport=broadcast",
                      f"sync.backend={'gloo' if args.device == 'cpu' else 'nccl'}"]
    return overrides


def sync_interval(policy: str, overrides: list[str]) -> int:
    """Trainer steps between two weight syncs of ``policy`` at most: its
    ``policy.trigger_parameter_sync_step`` (the last override of it wins; the
    config's default 1). The baselines sync after every step whatever it says."""
    every = 1
    for item in (*POLICIES[policy], *overrides):
        key, _, value = item.partition("=")
        if key.strip() == "policy.trigger_parameter_sync_step":
            every = int(value)
    return every


def rotated(items: list[str], seed: int) -> list[str]:
    """The order ``items`` (policies, or runtimes) run in for ``seed``: rotated one
    place per seed (two alternate), so none always runs first in a seed."""
    k = seed % len(items)
    return items[k:] + items[:k]


def _one(policy: str, seed: int, runtime: str, args: argparse.Namespace, workers: int = 1) -> dict[str, Any]:
    run = launch(ROOT / "fully_async.yaml", *run_overrides(policy, seed, runtime, args, workers))
    transport, weight_mode = run.weight_transport, run.weight_mode
    with run:
        # untimed warm-up, the same for every policy: an evaluation (step 0: the weights every policy
        # starts from), --warmup-steps steps with at least one weight sync, and that sync finished
        evals = [_evaluate(run)] if args.eval_prompts else []
        warm = run.train(args.warmup_steps)  # one-time costs of the actors' processes land here
        loop.run(run.policy.settle())  # a push still running (overlapped) ends before the window opens
        warmup_weight_version = loop.run(run.policy.rollouts[0].get_version())
        warmup_evals = len(evals) + (run.initial_eval is not None) + sum("eval/reward" in m for m in warm)
        engines0 = loop.run(_statistics(run))
        probes: list[dict[str, float]] = []
        probe = loop.run(_start(pipeline_report.probe_samples(run.policy, probes)))  # on the loop's own thread
        t0 = time.perf_counter()
        hist = run.train(args.steps)
        wall_with_eval_s = time.perf_counter() - t0
        loop.run(_cancel(probe))
        engines1 = loop.run(_statistics(run))
        engine0, engine1 = engines0[0], engines1[0]
        evals += [m for m in warm + hist if "eval/reward" in m]
        if args.eval_prompts and (not evals or evals[-1]["step"] != args.warmup_steps + args.steps):
            evals.append(_evaluate(run))  # after the timed window: the weights of the last step
    # the evaluations inside the timed window (--eval-every) count as its time unless asked otherwise:
    # fully-async keeps generating during them, the baselines do not
    eval_s = sum(m.get("eval/s", 0.0) for m in hist)
    wall_s = wall_with_eval_s if args.eval_in_window else wall_with_eval_s - eval_s
    # the engine's counters over the timed steps only (gauges such as num_running: at the end)
    gauges = ("num_running", "num_waiting", "kv_cache_bytes", "weights_bytes", "gc_pause_max_s")
    engine = {k: v if k in gauges or not isinstance(v, (int, float)) else round(v - engine0.get(k, 0), 4)
              for k, v in engine1.items()}
    k = max(1, len(hist) // 10)
    last = hist[-1]
    start = warm[-1] if warm else {"trained": 0, "elapsed_s": 0.0, "trainer_idle_ratio": 0.0,
                                   "rollout_idle_ratio": 0.0}
    # the idle ratios' span runs from the last warm-up step's record to the last step's record: it holds
    # the evaluation after that warm-up step (before the window), and those after the timed steps but
    # the last (in the window: left in unless --eval-outside-window)
    not_timed_s = start.get("eval/s", 0.0) + (0.0 if args.eval_in_window else
                                                 sum(m.get("eval/s", 0.0) for m in hist[:-1]))

    def idle(key: str) -> float:  # over the timed steps (the counters run from the start)
        busy = (1 - last[key]) * last["elapsed_s"] - (1 - start[key]) * start["elapsed_s"]
        return min(1.0, max(0.0, 1.0 - busy / (last["elapsed_s"] - start["elapsed_s"] - not_timed_s)))
    pipeline = pipeline_report.in_loop(hist, last["trained"] - start["trained"],
                                       pipeline_report.engine_counters(engines0),
                                       pipeline_report.engine_counters(engines1), wall_s, len(engines1))
    return {
        "seed": seed,
        "weight_transport": transport,
        "weight_mode": weight_mode,  # full or delta after the first push (sync.mode; auto resolved)
        "wall_s": wall_s,
        "wall_with_eval_s": wall_with_eval_s,
        "eval_s": eval_s,
        "steps_per_s": len(hist) / wall_s,
        # trained response tokens (the trainer's count) per second
        "tokens_per_s": sum(m["num_tokens"] for m in hist) / wall_s,
        "samples_per_s": (last["trained"] - start["trained"]) / wall_s,
        # what the warm-up did: the engine's weight version when the window opened (>= 1: a sync
        # was applied), evaluations run
        "warmup_steps": len(warm), "warmup_weight_version": warmup_weight_version, "warmup_evals": warmup_evals,
        **_eval_fields(evals),
        "trainer_idle_ratio": idle("trainer_idle_ratio"),
        "rollout_idle_ratio": idle("rollout_idle_ratio"),
        "final_reward": sum(m["reward"] for m in hist[-k:]) / k,
        "first_reward": sum(m["reward"] for m in hist[:k]) / k,
        "staleness_max": max(m["staleness_max"] for m in hist),
        "response_len_mean": statistics.fmean(m["response_len_mean"] for m in hist),
        "partial_ratio": sum(m["partial_ratio"] for m in hist) / len(hist),
        "dropped": last["dropped"],
        "sync_ms_mean": statistics.fmean(m.get("sync/total_ms", 0.0) for m in hist),
        # the trainer's step (batch in hand to weights stepped) and its model FLOPs
        "train_step_ms_mean": 1000 * statistics.fmean(m["train_s"] for m in hist),
        # the driver's wait for a step's batch: the step's time outside train_s and the push after it
        "wait_ms_mean": 1000 * statistics.fmean(m["wait_s"] for m in hist),
        "train_tflops_mean": statistics.fmean(m["train/tflops"] for m in hist),
        **({"mfu_mean": statistics.fmean(m["train/mfu"] for m in hist)} if "train/mfu" in last else {}),
        # trainer.cuda_graphs: buckets captured inside the window (a capture's seconds land in its step's
        # train_s) and micro-batches run in a bigger captured bucket than their own
        **({f"trainer_graph_{k}_in_window": last[f"train/{m}"] - start.get(f"train/{m}", 0.0)
            for k, m in (("captures", "cuda_graphs"), ("capture_s", "graph_capture_s"),
                         ("reuses", "cuda_graph_reuses"))} if "train/cuda_graphs" in last else {}),
        # where a sync's time goes: encode (trainer), transfer, apply (engine), and the
        # rest of the sequence (pause, abort, version checks, resume: engine round trips);
        # paused: how long the engines stood still (the encode runs before the pause
        # unless the KV cache is freed for the push)
        "sync_parts_ms_mean": _sync_parts(hist),
        "engine": engine,
        # issue 29 (bench/pipeline_report.py): the engines and trainer in the loop, sync cost, startup
        **pipeline,
        **pipeline_report.where_samples_are(probes),
        "startup_s": run.startup["total_s"],
        "startup": {k: round(v, 3) for k, v in run.startup.items()},
        "startup_actors": run.startup_actors,
    }


async def _start(coro: Any) -> asyncio.Task[Any]:
    """``coro`` as a task of the running loop (it runs on through the loop's next runs)."""
    return asyncio.ensure_future(coro)


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _statistics(run: Any) -> list[dict[str, Any]]:
    """Every rollout actor's ``statistics()`` (its engine's counters and its own)."""
    return list(await asyncio.gather(*(h.statistics() for h in run.policy.rollouts)))


def _evaluate(run: Any) -> dict[str, Any]:
    """The policy's held-out evaluation on the weights of its latest step, untimed."""
    return {"step": run.policy.step, **loop.run(run.policy.evaluate())}


def _eval_fields(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Held-out eval reward before the first step and after the last, with the
    trained samples at each evaluation (equal across policies: the same steps
    of the same batch size), and the whole curve."""
    if not evals:
        return {}
    return {
        "eval_reward_first": evals[0]["eval/reward"], "eval_reward_last": evals[-1]["eval/reward"],
        "eval_at_trained": evals[-1]["eval/at_trained"],
        "eval_curve": [[m["step"], m["eval/at_trained"], round(m["eval/reward"], 4)] for m in evals],
    }


def _sync_parts(hist: list[dict[str, Any]]) -> dict[str, Any]:
    syncs = [m for m in hist if "sync/total_ms" in m]
    if not syncs:
        return {}
    parts = {k: statistics.fmean(m.get(f"sync/{k}_ms", 0.0) for m in syncs)
             for k in ("encode", "stage", "transfer", "apply", "total", "paused")}
    # the stage is sent right behind by the swap: its time lies inside the apply's
    parts["sequence"] = parts["total"] - parts["encode"] - parts["transfer"] - parts["apply"]
    # the trainer's own encode time (the "encode" above also holds the call that fetched it)
    parts["sender_encode"] = statistics.fmean(m.get("sync/sender_encode_ms", 0.0) for m in syncs)
    # the trainer's whole call (weights gathered, encoded, published): "encode" less this is the call's trip
    parts["source"] = statistics.fmean(m.get("sync/source_ms", 0.0) for m in syncs)
    parts = {k: round(v, 2) for k, v in parts.items()}
    parts["kinds"] = dict(collections.Counter(m["sync/kind"] for m in syncs))
    parts["device_plan"] = sum(bool(m.get("sync/device_plan")) for m in syncs)  # syncs on the device fast path
    return parts


EVAL_IN_WINDOW = ("the in-loop evaluations (--eval-every) count in each run's timed window (wall_s "
                  "holds eval_s): fully-async's rollout keeps generating during them, the baselines' does not")
EVAL_OUTSIDE_WINDOW = (
    "the in-loop evaluations' time (eval_s) is subtracted from each run's timed window "
    "(wall_s = wall_with_eval_s - eval_s), but generation is not paused during them (pausing the "
    "rollout actors pauses the engine the evaluation runs on): fully-async's in-flight groups and "
    "feeder keep generating while the clock is stopped, generation the baselines do not get, so its "
    "throughput is overstated by up to eval_s of free generation")

#: Summarised over seeds (mean, spread, min and max), in this order: throughput side by side, then learning.
SUMMARY_KEYS = ("wall_s", "steps_per_s", "tokens_per_s", "samples_per_s", "trainer_idle_ratio",
                "rollout_idle_ratio", "eval_reward_first", "eval_reward_last", "eval_at_trained",
                "final_reward", "first_reward", "partial_ratio", "sync_ms_mean", "train_step_ms_mean", "wait_ms_mean",
                "train_tflops_mean", "mfu_mean", "eval_s", "trainer_graph_captures_in_window",
                "trainer_graph_capture_s_in_window", "trainer_graph_reuses_in_window",
                # issue 29: the loop against its parts alone (bench/pipeline_report.py)
                "engine_tokens_per_s", "sustained_tokens_per_s", "backlog_share",
                "engine_in_loop_over_standalone", "engine_busy_ratio",
                "engine_thread_cpu_share", "engine_offcpu_share", "rollout_loop_cpu_share", "rollout_process_cpu_share",
                "rollout_gc_share",
                "samples_admitted_mean", "samples_in_engine_mean", "samples_finished_in_rollout_mean",
                "samples_queued_mean", "samples_in_trainer_mean",
                "trainer_step_ms_median", "trainer_mfu", "trainer_in_loop_over_standalone",
                "sync_total_ms_median", "sync_total_ms_max", "sync_paused_ms_median", "sync_paused_ms_max",
                "startup_s", "pipeline_efficiency")


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in SUMMARY_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        if not values:  # e.g. no evaluations asked for
            continue
        out[key] = {"mean": statistics.fmean(values), "spread": max(values) - min(values),
                    "min": min(values), "max": max(values)}
    out["seeds"] = runs
    return out


#: What the speedup fields are, written into the JSON beside them.
SPEEDUP_NOTE = ("speedup_X_over_sync: mean over seeds of X's trained tokens/s over the mean of sync's (the "
                "headline; = speedup_tokens_per_s_X_over_sync); speedup_steps_per_s_X_over_sync: the same "
                "from steps/s; speedup_sustained_tokens_per_s_X_over_sync: from sustained_tokens_per_s (what "
                "the window's own generation sustains: below the headline where X trained a backlog "
                "generated before the window, backlog_share); each *_per_seed: the ratio seed by seed "
                "(runs of the same seed)")


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each policy's runs summarised over seeds (``policies``: mean, spread, min
    and max), and each policy's speedup over sync: the ratio of the means over
    seeds of trained tokens/s (the headline) and of steps/s (the two differ as
    response lengths do), and both seed by seed."""
    pol = {policy: _summarise(r) for policy, r in runs.items()}
    out: dict[str, Any] = {"policies": pol}
    if "sync" in pol and len(pol) > 1:
        out["speedup"] = SPEEDUP_NOTE
    for name in pol:
        if name != "sync" and "sync" in pol:
            for rate in ("tokens_per_s", "steps_per_s", "sustained_tokens_per_s"):
                if rate not in pol[name] or rate not in pol["sync"]:
                    continue  # sustained_tokens_per_s: not for runs without the engines' counters
                out[f"speedup_{rate}_{name}_over_sync"] = pol[name][rate]["mean"] / pol["sync"][rate]["mean"]
                out[f"speedup_{rate}_{name}_over_sync_per_seed"] = [
                    round(b[rate] / a[rate], 3) for a, b in zip(runs["sync"], runs[name])]
            out[f"speedup_{name}_over_sync"] = out[f"speedup_tokens_per_s_{name}_over_sync"]
            out[f"speedup_{name}_over_sync_per_seed"] = out[f"speedup_tokens_per_s_{name}_over_sync_per_seed"]
    return out


BACKLOG_NOTE_SHARE = 0.05  # a policy training more than this share of its window from before it gets a note


def backlog_notes(policies: dict[str, Any]) -> list[str]:
    """One line per policy whose windows trained more than ``BACKLOG_NOTE_SHARE`` of their
    tokens from samples generated before them (``backlog_share``, summarised by
    :func:`compare`): its trained tokens/s overstates what its generation sustains."""
    notes = []
    for name, summary in policies.items():
        share = summary.get("backlog_share")
        if share and share["max"] > BACKLOG_NOTE_SHARE:
            notes.append(f"{name} trained {share['min']:.0%}-{share['max']:.0%} of its windows' tokens from samples "
                         f"generated before them: sustained_tokens_per_s (and its speedup) is the figure its "
                         f"generation holds; a longer --warmup-steps or --steps window narrows the gap")
    return notes


#: --step-by-step's instruction: worked answers (SmolLM2-135M-Instruct: ~100-200 tokens, a tail to 512).
STEP_BY_STEP = "Think step by step, showing your working, then give the final answer as a number on the last line."


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (an unknown policy, runtime or task exits naming it)."""
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
    p.add_argument("--task", default=None,
                   help="long_tail_copy | reverse_digits (built-in symbol tasks) | text_arithmetic | text_dataset "
                        "(text tasks: a model.path=DIR override whose tokenizer has the text)")
    p.add_argument("--task-kwargs", type=_json_object, default={}, metavar="JSON",
                   help='the task\'s options as a JSON object, e.g. \'{"digits": 2, "ops": "+"}\' '
                        "(over --task-max-len / --tail-alpha)")
    p.add_argument("--batch-prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-response-tokens", type=int, default=None,
                   help="response budget per sample (default 100; 512 with --step-by-step)")
    p.add_argument("--step-by-step", action="store_true",
                   help="text_arithmetic with worked answers: the instruction asks for the steps and the final "
                        "number last (the math reward reads the last number), --max-response-tokens 512 unless "
                        "given; --task-kwargs still apply over it")
    p.add_argument("--no-standalone", dest="standalone", action="store_false",
                   help="skip the standalone engine and trainer measures before the timed runs (and the "
                        "fields set against them: *_over_standalone, pipeline_efficiency)")
    p.add_argument("--standalone-response-tokens", type=int, default=0,
                   help="response tokens of the standalone measures (0: the throw-away run's mean response "
                        "length; without that run, half of --max-response-tokens)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="the engine's max_model_len (0: the longest prompt plus --max-response-tokens; "
                        "256 prompt tokens for a text task)")
    p.add_argument("--task-max-len", type=int, default=96,
                   help="longest answer of the symbol tasks (not passed to text tasks)")
    p.add_argument("--tail-alpha", type=float, default=0.8,
                   help="Pareto shape of long_tail_copy's answer lengths (not passed to text tasks: "
                        "use --task-kwargs)")
    p.add_argument("--eval-prompts", type=int, default=0,
                   help="held-out prompts per evaluation (greedy, policy.eval_prompts); > 0 evaluates "
                        "before the first step and after the last, untimed (0: no evaluation)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also evaluate every this many trainer steps (policy.eval_every); their time counts "
                        "in the timed window (fully-async keeps generating during them, the baselines do not)")
    p.add_argument("--eval-outside-window", action="store_true",
                   help="subtract the --eval-every evaluations' time from the timed window (the old figures; "
                        "generation is not paused during them, so fully-async gains free generation)")
    p.add_argument("--staleness-threshold", type=float, default=2.0)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--policies", default="sync,one_step_off,fully_async,fully_async_k2")
    p.add_argument("--warmup-steps", type=int, default=3,
                   help="trainer steps each run takes untimed before the timed --steps; at least the longest "
                        "sync interval of the policies (1; 2 with fully_async_k2), so each warms a weight sync")
    p.add_argument("--no-warmup-run", dest="warmup_run", action="store_false",
                   help="skip the throw-away run before seed 0 (it takes what is paid once per process or "
                        "machine, such as on-disk kernel caches, out of the first timed run)")
    p.add_argument("--output-dir", default="/tmp/asyncrl-bench-runs")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--trainer-workers", default="1",
                   help="trainer.num_workers; a comma list (e.g. 1,2) runs each policy with each count in "
                        "turn (seed by seed) and compares their steps/s and step time")
    p.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = p.parse_args(argv)
    if args.step_by_step:
        if args.task not in (None, "text_arithmetic"):
            p.error(f"--step-by-step: a text_arithmetic preset, not for --task {args.task}")
        args.task, args.task_kwargs = "text_arithmetic", {"instruction": STEP_BY_STEP, **args.task_kwargs}
    args.task = args.task or "long_tail_copy"
    args.max_response_tokens = args.max_response_tokens or (512 if args.step_by_step else 100)
    if args.standalone_response_tokens < 0:
        p.error("--standalone-response-tokens must be >= 0")
    try:
        args.workers = [int(n) for n in args.trainer_workers.split(",")]
    except ValueError:
        p.error(f"--trainer-workers: expected a comma list of integers, got {args.trainer_workers!r}")
    if any(n < 1 for n in args.workers) or (len(args.workers) > 1 and len(args.runtime.split(",")) > 1):
        p.error("--trainer-workers: counts >= 1, and with one --runtime only")
    policies = args.policies.split(",")
    unknown = [name for name in policies if name not in POLICIES]
    if unknown:
        p.error(f"--policies: unknown {', '.join(map(repr, unknown))} (known: {', '.join(POLICIES)})")
    if args.eval_every < 0 or args.eval_prompts < 0:
        p.error("--eval-every and --eval-prompts must be >= 0")
    if args.eval_every and not args.eval_prompts:
        p.error("--eval-every needs --eval-prompts > 0")
    args.eval_in_window = not args.eval_outside_window
    try:
        need = {name: sync_interval(name, args.overrides) for name in policies}
    except ValueError:
        p.error("policy.trigger_parameter_sync_step: expected an integer")
    slowest = max(need, key=need.__getitem__)
    if args.warmup_steps < need[slowest]:
        p.error(f"--warmup-steps: at least {need[slowest]}, so every policy's warm-up holds a weight sync "
                f"({slowest} syncs every {need[slowest]} trainer step(s))")
    try:
        task_kwargs(args)
    except ValueError as e:
        p.error(str(e))
    for rt in args.runtime.split(","):
        if rt not in ("process", "ray", "local"):
            p.error(f"--runtime: {rt!r} is not one of process, ray, local")
    return args


def _standalone(args: argparse.Namespace, policies: list[str], runtime: str, workers: int,
                response_len: float | None) -> dict[str, Any]:
    """``pipeline_report.standalone`` on each policy's resolved config, with responses of
    ``--standalone-response-tokens``, else ``response_len`` (the throw-away run's mean),
    else half of ``--max-response-tokens``."""
    from actors.models import resolve_model_path

    configs = {policy: load_config(ROOT / "fully_async.yaml", run_overrides(policy, 0, runtime, args, workers))
               for policy in policies}
    first = configs[policies[0]]
    tokens = args.standalone_response_tokens or round(response_len or args.max_response_tokens / 2)
    source = ("--standalone-response-tokens" if args.standalone_response_tokens else
              "the throw-away run's mean" if response_len else "half of --max-response-tokens")
    out = pipeline_report.standalone(configs, str(resolve_model_path(first.model.path, first.base_dir)),
                                     max(1, tokens))
    return {**out, "response_tokens_from": source}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = args.policies.split(",")
    result: dict[str, Any] = {
        "bench": "async_vs_sync", "device": args.device, "placement": args.placement,
        "runtime": args.runtime, "free_kv": args.free_kv,
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(), "load_average_start": os.getloadavg(),
        "task": args.task, "steps": args.steps, "seeds": args.seeds,
        "batch_size": args.batch_prompts * args.n, "max_response_tokens": args.max_response_tokens,
        "task_kwargs": task_kwargs(args), "max_model_len": max_model_len(args),
        "eval_prompts": args.eval_prompts, "eval_every": args.eval_every,
        "eval_in_window": args.eval_in_window,
        "eval_in_window_means": EVAL_IN_WINDOW if args.eval_in_window else EVAL_OUTSIDE_WINDOW,
        "timing": "wall_s: the timed steps (wall_with_eval_s), less the evaluations inside them (eval_s) "
                  "only when eval_in_window is false; steps_per_s, tokens_per_s (trained response tokens) "
                  "and samples_per_s over wall_s; the evaluations before the first step and after the last "
                  "are untimed. eval_reward_*: greedy mean reward on the task's held-out prompts, "
                  "eval_at_trained: trained samples at the last evaluation (equal across policies)",
        "warmup_steps": args.warmup_steps,
        "warmup": "each run, untimed before its window: its own actors started, an evaluation (with "
                  "--eval-prompts), --warmup-steps trainer steps holding at least one weight sync, that "
                  "sync finished (per run: warmup_weight_version >= 1, warmup_evals)",
        "policy_order": {},
        "staleness_threshold": args.staleness_threshold, "max_staleness": args.max_staleness,
        "overrides": args.overrides,
        "policies": {},
    }
    runtimes = args.runtime.split(",")
    # each side: a runtime, or with several --trainer-workers one runtime at each count
    sides = {rt: (rt, 1) for rt in runtimes} if len(args.workers) == 1 and args.workers[0] == 1 else {
        f"{rt}:w{n}": (rt, n) for rt in runtimes for n in args.workers}
    runtimes = list(sides)
    every: dict[str, dict[str, list[dict[str, Any]]]] = {rt: {policy: [] for policy in policies} for rt in runtimes}
    result["warmup_run"] = args.warmup_run
    warm_response_len = None
    if args.warmup_run:  # what a process or machine pays once (disk kernel caches; the local runtime's
        # own process) lands here, not in seed 0's first run; a seed no timed run uses, results dropped
        result["warmup_runs"] = []
        for rt in runtimes:
            first = rotated(policies, 0)[0]
            t0 = time.perf_counter()
            warm = _one(first, args.seeds, sides[rt][0], args, sides[rt][1])
            warm_response_len = warm_response_len or warm.get("response_len_mean")
            result["warmup_runs"].append({"policy": first, "runtime": rt, "seed": args.seeds,
                                          "seconds": round(time.perf_counter() - t0, 2),
                                          **({"startup_s": warm["startup_s"]} if "startup_s" in warm else {})})
            print(f"[async_vs_sync] throw-away warm-up run {first} {rt}: "
                  f"{result['warmup_runs'][-1]['seconds']:.2f} s with setup", file=sys.stderr)
    stand = None
    if args.standalone:  # the engine and the trainer alone, on the runs' model and shapes
        stand = _standalone(args, policies, *sides[runtimes[0]], warm_response_len)
        result["standalone"], result["pipeline_fields"] = stand, pipeline_report.FIELDS
        print(f"[async_vs_sync] standalone engine and trainer: {stand['seconds']:.2f} s", file=sys.stderr)
    for seed in range(args.seeds):  # seed-major: a drift in the machine's load hits every policy alike
        order = rotated(policies, seed)  # and the order rotates: no policy always runs first in a seed
        result["policy_order"][str(seed)] = order
        if len(runtimes) > 1:
            result.setdefault("runtime_order", {})[str(seed)] = rotated(runtimes, seed)
        for position, policy in enumerate(order):
            for rt in rotated(runtimes, seed):
                one = _one(policy, seed, sides[rt][0], args, sides[rt][1])
                every[rt][policy].append({**one, **pipeline_report.efficiency(one, policy, stand),
                                          "position": position})
                print(f"[async_vs_sync] seed {seed} {policy} {rt}: {every[rt][policy][-1]['wall_s']:.2f} s",
                      file=sys.stderr)
                if args.out:  # every finished run is kept, should the invocation be cut short
                    pathlib.Path(args.out).write_text(json.dumps({**result, "partial": True, "runs_so_far": every},
                                                                 indent=1))
    runs = every[runtimes[0]]
    result.update(compare(runs))
    for note in backlog_notes(result["policies"]):
        print(f"[async_vs_sync] {note}", file=sys.stderr)
    if len(runtimes) > 1:  # the same policies under the other runtimes, and their sync cost against the first's
        result["other_runtimes"] = {rt: {policy: _summarise(r) for policy, r in every[rt].items()}
                                    for rt in runtimes[1:]}
        for rt in runtimes[1:]:
            result[f"sync_ms_ratio_{runtimes[0]}_over_{rt}"] = {
                policy: [round(a["sync_ms_mean"] / b["sync_ms_mean"], 3) if b["sync_ms_mean"] else None
                         for a, b in zip(runs[policy], every[rt][policy])]
                for policy in policies}
    if len(args.workers) > 1:  # how a step scales with trainer workers: steps/s against the first count's
        first = runtimes[0]
        result["trainer_workers"] = args.workers
        for rt in runtimes[1:]:
            result[f"steps_per_s_ratio_{rt.split(':')[1]}_over_{first.split(':')[1]}"] = {
                policy: [round(a["steps_per_s"] / b["steps_per_s"], 3)
                         for a, b in zip(every[rt][policy], runs[policy])] for policy in policies}
    result["load_average_end"] = os.getloadavg()
    text = json.dumps(result)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
