"""Rewards that take time: scored several at once on the rollout actor's reward
pool (``policy.reward_workers``), an ``async def`` reward awaited at once; the
run's own counters say how many calls ran together. And a run always ends:
SIGTERM (SIGINT) while reward calls are blocked exits 143 (130) within ``run.stop_grace_s``
plus a few seconds, with its line and a ``summary.json``."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

import loop
from actors import notebook
from actors.launch import launch
from policies.rewards import TimedReward

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = ["task.type=text_dataset", f"task.kwargs.path={ROOT / 'examples' / 'arithmetic_train.jsonl'}",
        "task.kwargs.chat_template=false", "run.progress=false"]
ONE_GROUP = ["trainer.batch_prompts=1", "rollout.n=8", "policy.staleness_threshold=0", "rollout.max_response_tokens=4"]

pytestmark = pytest.mark.timeout(120)


def test_concurrent_calls_of_a_user_reward_each_run_on_a_thread_at_once():
    meet = threading.Barrier(8, timeout=10)  # broken (an error) unless all 8 calls are in at once
    fn = TimedReward(lambda text, answer: meet.wait() >= 0, name="meet", timeout_s=20)
    results: list[float] = []
    callers = [threading.Thread(target=lambda: results.append(fn("t", "a"))) for _ in range(8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert results == [1.0] * 8


def _rollout_stats(run) -> dict:
    async def gather() -> list[dict]:
        return await asyncio.gather(*(h.statistics() for h in run.policy.rollouts))

    (stats,) = loop.run(gather())
    return stats


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_slow_reward_scores_a_step_with_eight_calls_at_once_on_a_pool_of_eight(tmp_path, kind):
    sleep = "time.sleep(0.5)" if kind == "def" else "await asyncio.sleep(0.5)"
    (tmp_path / "slow.py").write_text(f"import asyncio, time\n{kind} reward(text, answer):\n    {sleep}\n"
                                      "    return 0.5\n")
    run = launch(ROOT / "fully_async.yaml", *TEXT, *ONE_GROUP, f"task.kwargs.reward={tmp_path / 'slow.py'}:reward",
                 "policy.reward_workers=8", f"run.output_dir={tmp_path / 'runs'}")
    with run:
        run.train(1)
        run.interrupt()
        stats = _rollout_stats(run)
    assert stats["num_reward_calls"] >= 8 and stats["num_reward_errors"] == 0
    assert stats["reward_call_s"] >= 0.5 * stats["num_reward_calls"]
    # calls at once, on average: the serial time over the wall time spent scoring (1 when one at a time)
    assert stats["reward_call_s"] / stats["reward_busy_s"] > 4, stats


def test_a_pool_of_one_scores_one_call_at_a_time(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ndef reward(text, answer):\n    time.sleep(0.1)\n    return 1.0\n")
    run = launch(ROOT / "fully_async.yaml", *TEXT, *ONE_GROUP, f"task.kwargs.reward={tmp_path / 'slow.py'}:reward",
                 "policy.reward_workers=1", f"run.output_dir={tmp_path / 'runs'}")
    with run:
        run.train(1)
        stats = _rollout_stats(run)
    assert stats["num_reward_calls"] >= 8
    assert stats["reward_call_s"] / stats["reward_busy_s"] <= 1.0, stats


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_reward_calls_are_blocked_exits_143_or_130_within_the_grace_with_a_summary(tmp_path, signum):
    (tmp_path / "stuck_reward.py").write_text(
        "import pathlib, time\n"
        "def reward(text, answer):\n"
        f"    pathlib.Path({str(tmp_path / 'called')!r}).touch()\n"
        "    time.sleep(3600)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "actors.launch", "fully_async.yaml", *TEXT,
                             "task.kwargs.reward=stuck_reward:reward", "policy.reward_timeout_s=3600",
                             "run.stop_grace_s=2", f"run.output_dir={tmp_path / 'runs'}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (tmp_path / "called").exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "no reward call in 90 s"
        time.sleep(0.05)
    time.sleep(0.5)  # every worker of the pool is blocked now
    t0 = time.monotonic()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 2 + 10
    assert proc.returncode == 128 + signum, err[-2000:]
    name = signal.Signals(signum).name
    ack, line = err.strip().splitlines()
    assert ack.startswith(f"{name}: stopping after step 1 with a checkpoint (within 2 s, run.stop_grace_s")
    assert line == f"stopped by {name} (no step boundary within 2 s, run.stop_grace_s), without a checkpoint"
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == line


def test_the_progress_display_names_the_setup_phase_and_the_samples_being_scored(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(notebook, "interactive", lambda: True)  # as in a terminal: the setup line is shown
    (tmp_path / "slow.py").write_text("import time\ndef reward(text, answer):\n    time.sleep(0.4)\n    return 1.0\n")
    run = launch(ROOT / "fully_async.yaml", *TEXT, *ONE_GROUP, f"task.kwargs.reward={tmp_path / 'slow.py'}:reward",
                 "policy.reward_workers=1", "run.progress=true", f"run.output_dir={tmp_path / 'runs'}")
    with run:
        run.train(1)  # 8 samples, 0.4 s each, one at a time: about 3 s of scoring
    err = capsys.readouterr().err
    assert "setup: starting the trainer and rollout actors" in err
    assert any(f"scoring {n} samples" in err for n in range(2, 9)), err[-2000:]
