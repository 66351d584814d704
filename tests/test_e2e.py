"""A few steps of the real run (built-in engine, torch trainer, TransferQueue,
delta weight sync) under both runtimes, and the CLI end to end."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time

import pytest

import loop
from actors.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHORT = ["run.total_steps=4", "trainer.batch_prompts=2", "rollout.n=4", "run.progress=false",
         "rollout.max_response_tokens=8"]


def _check_rollout_counts(run, stopped: bool = True) -> dict:
    """Each rollout actor's own count, read from it: every sample of every group it
    finished is queued or dropped before the queue (at any time). ``stopped``: with
    rollout stopped (``run.check``: their counters are their last reports') the
    actors' queued is exactly what the queue registered as put; else the policy's
    check bounds it. Returns the actors' statistics."""
    if stopped:
        run.check()
    else:
        loop.run(run.policy.check_accounting())
    stats = {h.name: loop.run(h.statistics()) for h in run.policy.rollouts}
    for name, st in stats.items():
        assert st["num_generated"] == st["num_queued"] + sum(st["dropped"].values()) > 0, (name, st)
    if stopped:
        assert sum(st["num_queued"] for st in stats.values()) == loop.run(run.queue.statistics_async()).put
    return stats


def _check_run(run, steps: int) -> None:
    h = run.history
    assert len(h) == steps
    assert [m["step"] for m in h] == list(range(1, steps + 1))
    for m in h:
        assert m["produced"] == m["trained"] + sum(m["dropped"].values()) + m["pending"]
        assert m["staleness_max"] <= run.cfg.policy.max_staleness
        assert 0.0 <= m["reward"] <= 1.0
        assert 0.0 <= m["zero_adv_group_share"] <= 1.0
    kinds = [m["sync/kind"] for m in h]
    assert kinds[0] == "full" and set(kinds[1:]) <= {"delta"}, kinds
    assert all(0.0 <= m["sync/changed_fraction"] <= 1.0 for m in h)
    lines = (run.dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == steps and json.loads(lines[-1])["step"] == steps
    assert (run.dir / "config.yaml").is_file()
    _check_rollout_counts(run)


@pytest.mark.parametrize(("runtime", "queue"), [("local", "local"), pytest.param("ray", "ray", marks=pytest.mark.ray)])
def test_fully_async_run_trains_a_few_steps(runtime, queue, tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"runtime.type={runtime}", f"transfer_queue.deployment={queue}",
                 f"run.output_dir={tmp_path}")
    try:
        assert run.cfg.policy.batch_order == "admission"  # the default: the oldest groups admitted, whole
        run.train(steps=2)  # step by step, as from a notebook
        run.train(steps=2)
        _check_run(run, 4)
    finally:
        run.close()
    assert json.loads((run.dir / "summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize("policy", ["sync", "one_step_off"])
def test_baseline_policies_run_on_the_same_parts(policy, tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"policy.type={policy}", f"run.output_dir={tmp_path}")
    with run:
        run.train(steps=3)
        lags = [m["staleness_max"] for m in run.history]
        _check_rollout_counts(run)
    assert lags == ([0, 0, 0] if policy == "sync" else [0, 1, 1])


def test_cli_runs_the_default_job_and_prints_a_summary(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "actors.launch", "fully_async.yaml", *SHORT, f"run.output_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])["summary"]
    assert summary["steps"] == 4


class _FlakyReward:
    """A task whose reward raises for every third call: the run must count and
    isolate those samples, never crash or lose them."""

    def __init__(self, **kwargs):
        from policies.tasks import make_task

        self._inner = make_task("reverse_digits", **kwargs)
        self._calls = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def reward(self, meta, response_ids):
        self._calls += 1
        if self._calls % 3 == 0:
            raise ZeroDivisionError("user reward bug")
        return self._inner.reward(meta, response_ids)


def test_a_reward_function_that_raises_is_counted_and_isolated(tmp_path):
    from policies.tasks import register_task

    register_task("flaky_reverse_digits", _FlakyReward)
    run = launch(ROOT / "fully_async.yaml", *SHORT, "task.type=flaky_reverse_digits",
                 f"run.output_dir={tmp_path}")
    with run:
        run.train(steps=3)
        last = run.history[-1]
        # its drops free admission slots: rollout goes on between train calls, never stopped to check
        (st,) = _check_rollout_counts(run, stopped=False).values()
    assert st["dropped"]["reward_error"] > 0 and st["dropped"]["group_incomplete"] > 0  # the actor's own count
    assert last["dropped"]["reward_error"] > 0
    assert last["dropped"].get("group_incomplete", 0) > 0  # their group-mates, counted too
    assert last["produced"] == last["trained"] + sum(last["dropped"].values()) + last["pending"]


def test_train_works_from_a_notebook_whose_thread_runs_a_loop(tmp_path):
    import asyncio

    async def cell():
        run = launch(ROOT / "fully_async.yaml", *SHORT, f"run.output_dir={tmp_path}")
        try:
            return [m["step"] for m in run.train(steps=2)]
        finally:
            run.close()

    assert asyncio.run(cell()) == [1, 2]


def test_fully_async_trains_its_next_step_while_the_weights_are_pushed(tmp_path):
    """The trainer waits for the encode only: a push still running when the
    next step starts is finished before its record is written, and before
    train() returns (no engine is left paused when the loop stops)."""
    import asyncio

    import loop

    run = launch(ROOT / "fully_async.yaml", *SHORT, "policy.overlap_push=true", f"run.output_dir={tmp_path}")
    with run:
        assert run.policy.overlap_push
        policy, push, train_step = run.policy, run.policy.weight_sync, run.policy.trainer.train_step
        steps_begun: list[int] = []
        overlapped: list[bool] = []

        async def counting_train_step(samples):
            steps_begun.append(policy.step + 1)
            return await train_step(samples)

        async def held_push(rollouts, trainer, released=None):
            """The real push, held open until the trainer has begun its next step."""
            task = asyncio.ensure_future(push(rollouts, trainer, released=released))
            await released.wait()
            step = policy.step
            for _ in range(200):  # 2 s: the last push of train() has no next step
                if step + 1 in steps_begun:
                    break
                await asyncio.sleep(0.01)
            overlapped.append(step + 1 in steps_begun)
            return await task

        policy.trainer.train_step, policy.weight_sync = counting_train_step, held_push
        records = run.train(steps=3)
        assert overlapped == [True, True, False]
        assert [m["sync/version"] for m in records] == [1, 2, 3]
        assert all(loop.run(r.get_version()) == 3 for r in policy.rollouts)
    lines = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["sync/version"] for m in lines] == [1, 2, 3]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_push_every_second_step_is_in_its_own_steps_record(overlap, tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, "policy.trigger_parameter_sync_step=2",
                 f"policy.overlap_push={str(overlap).lower()}", f"run.output_dir={tmp_path}")
    with run:
        assert run.policy.overlap_push == overlap  # auto (null) on one CPU would be false
        run.train(steps=4)
    lines = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("sync/version") for m in lines] == [None, 2, None, 4]


def test_an_overlapped_push_that_fails_stops_training_with_its_error(tmp_path):
    """A push running beside the next step that fails is raised by train(),
    not lost and not a hang (the trainer may be waiting for a batch meanwhile)."""
    import asyncio

    run = launch(ROOT / "fully_async.yaml", *SHORT, "policy.overlap_push=true", f"run.output_dir={tmp_path}")
    with run:
        policy, push = run.policy, run.policy.weight_sync
        calls = [0]

        async def failing_second_push(rollouts, trainer, released=None):
            calls[0] += 1
            if calls[0] == 2:
                released.set()
                await asyncio.sleep(0.05)
                raise RuntimeError("link down during push 2")
            return await push(rollouts, trainer, released=released)

        policy.weight_sync = failing_second_push
        with pytest.raises(RuntimeError, match="link down during push 2"):
            run.train(steps=4)
        assert calls[0] == 2


def test_held_out_eval_reward_is_logged_every_n_steps(tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, "policy.eval_every=2", "policy.eval_prompts=6",
                 f"run.output_dir={tmp_path}")
    with run:
        run.train(steps=4)
    lines = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]  # step 0: the weights before training
    assert ["eval/reward" in m for m in lines] == [True, False, True, False, True]
    assert lines[0]["eval/at_trained"] == 0
    summary = run.summary()
    assert summary["eval_reward_first"] == round(lines[0]["eval/reward"], 4)
    assert summary["eval_reward_last"] == round(lines[-1]["eval/reward"], 4)
    for m in lines[2::2]:
        assert 0.0 <= m["eval/reward"] <= 1.0 and m["eval/num_prompts"] == 6 and m["eval/num_errors"] == 0
        assert m["eval/at_trained"] == m["trained"]


@pytest.mark.parametrize("policy_type,overlap,max_staleness,pushed", [
    ("fully_async", 2, 4, [3, 6, 9]), ("fully_async", 2, 2, [2, 3, 5, 6, 8, 9]),
    ("fully_async", 0, 4, list(range(1, 10))), ("sync", 2, 4, list(range(1, 10)))])
def test_an_evaluation_runs_beside_training_and_no_push_lands_during_it(tmp_path, policy_type, overlap,
                                                                         max_staleness, pushed):
    """The evaluation of step s keeps the engines on version s to its end (no push starts
    meanwhile), while fully-async trains up to ``eval_overlap_steps`` more steps beside it
    (at most ``max_staleness - 1``); the pushes due meanwhile wait, the latest weights go.
    The first evaluation (step 0, the weights before training) runs beside step 1 so."""
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"policy.type={policy_type}", "policy.eval_every=3",
                 "policy.eval_prompts=4", f"policy.eval_overlap_steps={overlap}",
                 f"policy.max_staleness={max_staleness}", f"run.output_dir={tmp_path}")
    with run:
        policy = run.policy
        evals, pushes, real_evaluate, real_push = [], [], policy._evaluate, policy.weight_sync

        async def slow_evaluate(at_trained):
            t0, start = time.perf_counter(), (policy.step, await policy.rollouts[0].get_version())
            out = await real_evaluate(at_trained)
            await asyncio.sleep(0.6)  # a long evaluation: the trainer has time to go on beside it
            evals.append((start, (policy.step, await policy.rollouts[0].get_version()), t0, time.perf_counter()))
            return out

        async def recorded_push(*args, **kwargs):
            pushes.append((policy.step, time.perf_counter()))
            return await real_push(*args, **kwargs)

        policy._evaluate, policy.weight_sync = slow_evaluate, recorded_push
        run.train(steps=9)
    for (step, version), (step_end, version_end), t0, t1 in evals:
        assert version == version_end == step  # the engines held the evaluated step's weights to its end
        assert not any(t0 < t < t1 for _, t in pushes)
    (_, steps_beside), *_ = [(e[0][0], e[1][0] - e[0][0]) for e in evals if e[0][0] == 3]
    beside = min(overlap, max_staleness - 1) if policy_type == "fully_async" else 0
    assert steps_beside == beside + 1
    assert [e[1][0] for e in evals if e[0][0] == 0] == [beside + 1]  # step 0's too: no wait before step 1
    assert [step for step, _ in pushes] == pushed
    assert not any(m["dropped"] for m in run.history)  # nothing generated beside an evaluation went stale
    lines = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(10))
    assert [m["step"] for m in lines if "eval/reward" in m] == [0, 3, 6, 9]
    assert all(m["eval/at_trained"] == m["trained"] for m in lines[1:] if "eval/reward" in m)
    assert all(m["staleness_max"] <= max_staleness for m in lines[1:])  # the age bound holds beside evaluations


def test_startup_is_timed_by_phase_to_the_first_step_and_reported_once(tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, "policy.eval_every=2", "policy.eval_prompts=2",
                 f"run.output_dir={tmp_path}")
    with run:
        run.train(steps=2)
        first, second = run.history
    phases = {"config_s", "task_s", "runtime_s", "roles_s", "queue_s", "actors_s", "weight_link_s", "policy_s",
              "before_train_s", "initial_eval_s", "first_step_s"}
    assert set(run.startup) == phases | {"total_s"} and all(v >= 0 for v in run.startup.values())
    assert sum(run.startup[k] for k in phases) <= run.startup["total_s"]
    # each actor's own parts, inside actors_s
    assert set(run.startup_actors) == {"trainer", "rollout-0"}
    assert {"import_s", "model_s"} <= set(run.startup_actors["trainer"])
    assert {"import_s", "task_s", "engine_s"} <= set(run.startup_actors["rollout-0"])
    assert all(0 <= v <= run.startup["actors_s"] for parts in run.startup_actors.values() for v in parts.values())
    assert first["startup/trainer/model_s"] == run.startup_actors["trainer"]["model_s"]
    # in the first step's record (and its line in metrics.jsonl) only
    assert first["startup/total_s"] == round(run.startup["total_s"], 4)
    assert not any(k.startswith("startup/") for k in second)
    lines = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [("startup/first_step_s" in m) for m in lines] == [False, True, False]  # step 0: the eval
