"""A script's run always ends cleanly: one that never calls ``run.close()`` and
one whose ``train()`` raises both exit with Python's own code (0, 1), never an
abort, and leave a ``summary.json`` saying how the run ended."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
from actors.launch import launch
run = launch("fully_async.yaml", "run.progress=false", "trainer.batch_prompts=2", "rollout.n=4",
             "run.output_dir={out}")
run.train(1)
{then}
"""


def _script(tmp_path: pathlib.Path, then: str) -> subprocess.CompletedProcess:
    code = SCRIPT.format(out=tmp_path / "runs", then=then)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100)


def _summary(tmp_path: pathlib.Path) -> dict:
    (run_dir,) = (tmp_path / "runs").iterdir()
    return json.loads((run_dir / "summary.json").read_text())


def test_a_script_that_never_closes_its_run_exits_0_with_a_summary(tmp_path):
    done = _script(tmp_path, "print('done')")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "done" and "terminate called" not in done.stderr
    summary = _summary(tmp_path)
    assert summary["steps"] == 1 and summary["stopped"] == "closed at exit: the script ended without run.close()"


def test_a_script_whose_train_raises_exits_1_with_a_summary(tmp_path):
    done = _script(tmp_path, "run.cfg.run.watchdog_s = 0.01\nrun.train(1)")  # raises mid-step: NoProgressError
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" in done.stderr and "terminate called" not in done.stderr
    summary = _summary(tmp_path)
    assert summary["steps"] == 1
    assert summary["stopped"].startswith("closed at exit after the script raised NoProgressError: no trainer step")
