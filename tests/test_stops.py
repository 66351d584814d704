"""How a command-line run stops when something a user did goes wrong: a reward
function that fails on every sample stops the run within seconds with its error;
SIGTERM before the first step (during setup, or with the step stuck) exits 143
with one line, no traceback. (SIGTERM mid-run, with its checkpoint: tests/test_resume.py.)"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from contracts.rollout import GroupReport
from policies.reward_guard import RewardGuard, RewardsFailing

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = ["task.type=text_dataset", f"task.kwargs.path={ROOT / 'examples' / 'arithmetic_train.jsonl'}",
        "task.kwargs.chat_template=false", "task.kwargs.reward=user_reward:reward", "run.progress=false"]

pytestmark = pytest.mark.timeout(120)


def _start(tmp_path: pathlib.Path, *overrides: str) -> subprocess.Popen:
    """The CLI on fully_async.yaml, with ``user_reward.py`` (in ``tmp_path``) importable:
    its reward writes ``called`` when it first runs, then raises."""
    (tmp_path / "user_reward.py").write_text(
        "import pathlib\n"
        "def reward(text, answer):\n"
        f"    pathlib.Path({str(tmp_path / 'called')!r}).touch()\n"
        "    return int('not a number: ' + text)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "actors.launch", "fully_async.yaml", *TEXT,
                             f"run.output_dir={tmp_path / 'runs'}", *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(what: str, ready, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s"
        time.sleep(0.02)


def _summary(tmp_path: pathlib.Path) -> dict:
    (run_dir,) = (tmp_path / "runs").iterdir()
    return json.loads((run_dir / "summary.json").read_text())


def test_a_reward_that_always_raises_stops_the_run_in_seconds_naming_the_exception_and_its_line(tmp_path):
    t0 = time.monotonic()
    proc = _start(tmp_path)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 1, err[-2000:]
    (line,) = err.strip().splitlines()
    assert line.startswith("error: the reward function 'user_reward:reward' failed on 16 of the last 16 scored "
                           "samples (policy.max_reward_error_share=0.5): ValueError: invalid literal for int()"), line
    assert f"({tmp_path / 'user_reward.py'}:4)" in line and "Traceback" not in err
    assert _summary(tmp_path)["stopped"] in line and _summary(tmp_path)["steps"] == 0


def test_sigterm_during_setup_is_acknowledged_and_exits_143_in_one_line(tmp_path):
    proc = _start(tmp_path)
    _wait_for("run directory", lambda: (tmp_path / "runs").is_dir() and any((tmp_path / "runs").iterdir()), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    ack, line = err.strip().splitlines()
    assert ack.startswith("SIGTERM: stopping once the run is set up, before its first step (within 30 s")
    assert line == "stopped by SIGTERM during setup, without a checkpoint" and "Traceback" not in err


def test_sigterm_with_the_first_step_stuck_exits_143_after_the_grace_in_one_line(tmp_path):
    proc = _start(tmp_path, "policy.max_reward_error_share=1.0", "run.stop_grace_s=2")  # no step will finish
    _wait_for("the first reward call", (tmp_path / "called").exists, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert 2 <= time.monotonic() - t0 < 30
    ack, line = err.strip().splitlines()
    assert ack.startswith("SIGTERM: stopping after step 1 with a checkpoint (within 2 s, run.stop_grace_s")
    assert line == "stopped by SIGTERM (no step boundary within 2 s, run.stop_grace_s), without a checkpoint"
    assert "Traceback" not in err and _summary(tmp_path)["stopped"] == line


def _report(scored: int, failed: int) -> GroupReport:
    return GroupReport(group_id="g", num_samples=scored, num_queued=0, num_scored=scored,
                       num_reward_errors=failed, reward_error="ValueError: x (f.py:1)" if failed else None)


def test_the_reward_guard_stops_past_the_share_over_its_window_from_the_second_group_on():
    guard = RewardGuard(name="'r'", max_share=0.5, window=16, min_samples=8)
    guard.observe(_report(4, 4))  # one group failing whole: not yet
    with pytest.raises(RewardsFailing, match=r"^the reward function 'r' failed on 8 of the last 8 scored samples "
                                             r"\(policy.max_reward_error_share=0.5\): ValueError: x \(f.py:1\)$"):
        guard.observe(_report(4, 4))
    flaky = RewardGuard(name="'r'", max_share=0.5, window=16, min_samples=8)
    for _ in range(50):  # a share at the bound never stops; old groups leave the window
        flaky.observe(_report(4, 2))
    flaky.observe(_report(4, 0))
    assert flaky.last_error == "ValueError: x (f.py:1)"
    never = RewardGuard(name="'r'", max_share=1.0, window=16, min_samples=8)
    for _ in range(10):
        never.observe(_report(4, 4))
