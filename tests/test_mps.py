"""``runtime.mps``: the run's own MPS control daemon, started before its actor
processes and stopped after them (actors/mps.py).

The CPU tests put a FAKE ``nvidia-cuda-mps-control`` on PATH (a shell script that
logs how it was called); the ``gpu`` test runs the real daemon with a CUDA client."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys

import msgspec
import pytest

import loop
from actors import mps
from actors.config import ConfigError, load_config
from actors.mps import MpsDaemon

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A FAKE control daemon: ``-d`` logs the directories it was given; the front end logs
# each command read from stdin. FAKE_MPS_FAIL makes ``-d`` fail as a second daemon would;
# FAKE_MPS_OLD makes the front end refuse ``quit -t``, as a daemon older than it would.
_FAKE = """#!/bin/sh
if [ "$1" = "-d" ]; then
  if [ -n "$FAKE_MPS_FAIL" ]; then echo "An instance of this daemon is already running" >&2; exit 1; fi
  echo "daemon $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"; exit 0
fi
while read -r line; do
  echo "command $CUDA_MPS_PIPE_DIRECTORY $line" >> "$FAKE_MPS_LOG"
  case "$line" in "quit -t"*) if [ -n "$FAKE_MPS_OLD" ]; then echo "Invalid command: quit -t"; fi;; esac
done
"""


@pytest.fixture
def fake_daemon(tmp_path, monkeypatch) -> pathlib.Path:
    """PATH with the fake daemon first, no MPS variables set; returns its log file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / mps.CONTROL
    exe.write_text(_FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "fake_mps.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    for var in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        monkeypatch.delenv(var, raising=False)
    return log


def _child_env(var: str) -> str:
    return subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({var!r}, ''))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_daemon_of_its_own_serves_processes_started_after_it_and_is_quit(fake_daemon):
    daemon = MpsDaemon.start()
    root = pathlib.Path(daemon.pipe_dir).parent
    assert daemon.owned and pathlib.Path(daemon.pipe_dir).is_dir() and pathlib.Path(daemon.log_dir).is_dir()
    assert len(daemon.pipe_dir) < 80  # unix-socket paths stay short whatever the run directory
    assert fake_daemon.read_text().split() == ["daemon", daemon.pipe_dir, daemon.log_dir]
    assert _child_env("CUDA_MPS_PIPE_DIRECTORY") == daemon.pipe_dir  # a later process is its client
    daemon.stop()
    assert fake_daemon.read_text().splitlines()[-1] == f"command {daemon.pipe_dir} quit -t {mps.QUIT_TIMEOUT_S}"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and "CUDA_MPS_LOG_DIRECTORY" not in os.environ
    assert not root.exists()
    daemon.stop()  # once only
    assert len(fake_daemon.read_text().splitlines()) == 2


def test_a_daemon_too_old_for_a_quit_timeout_is_quit_plainly(fake_daemon, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_OLD", "1")
    daemon = MpsDaemon.start()
    daemon.stop()
    assert [line.split(" ", 2)[2] for line in fake_daemon.read_text().splitlines()[1:]] == \
        [f"quit -t {mps.QUIT_TIMEOUT_S}", "quit"]


def test_a_daemon_the_environment_names_is_used_as_it_is(fake_daemon, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "theirs"))
    daemon = MpsDaemon.start()
    daemon.stop()
    assert not daemon.owned and daemon.pipe_dir == str(tmp_path / "theirs")
    assert fake_daemon.read_text() == ""  # never started nor quit here
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "theirs")


def test_a_daemon_that_fails_to_start_is_one_line_and_leaves_nothing(fake_daemon, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    made_before = set(pathlib.Path(os.environ.get("TMPDIR", "/tmp")).glob("asyncrl-mps-*"))
    with pytest.raises(RuntimeError) as err:
        MpsDaemon.start()
    assert str(err.value) == (f"runtime.mps: {mps.CONTROL} -d failed (exit 1): "
                              "An instance of this daemon is already running")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert set(pathlib.Path(os.environ.get("TMPDIR", "/tmp")).glob("asyncrl-mps-*")) == made_before


@pytest.mark.parametrize(("overrides", "message"), [
    (["runtime.mps=true"], "runtime.mps: needs runtime.type=process (got 'local'"),
    (["runtime.mps=true", "runtime.type=process"], "runtime.mps: no actor is on a GPU"),
    (["runtime.mps_trainer_sm_percent=60"], "runtime.mps_trainer_sm_percent: needs runtime.mps=true"),
])
def test_mps_where_it_cannot_apply_is_a_config_error(fake_daemon, overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config(None, overrides)


def test_mps_without_its_daemon_on_path_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with pytest.raises(ConfigError, match=f"^runtime.mps: {mps.CONTROL} is not on PATH"):
        load_config(None, ["runtime.mps=true", "runtime.type=process", "trainer.device=cuda"])


def test_a_process_run_starts_its_actors_as_clients_and_quits_the_daemon_after_them(fake_daemon, tmp_path):
    """The wiring: the daemon before the first actor process (the prestarted ones too),
    its stop after the last. (A CPU run with ``runtime.mps`` forced past the config check,
    which refuses it: no actor on a GPU; the fake daemon stands in for the real one.)"""
    from actors.run import Run

    cfg = load_config(ROOT / "fully_async.yaml", ["runtime.type=process", f"run.output_dir={tmp_path}",
                                                  "run.progress=false"])
    cfg = msgspec.structs.replace(cfg, runtime=msgspec.structs.replace(cfg.runtime, mps=True,
                                                                       mps_trainer_sm_percent=60))
    run = Run(cfg)
    try:
        pipe = run.mps.pipe_dir
        handles = [run.policy.trainer, *run.policy.rollouts]
        pids = loop.run(_pids(handles))
        for i, pid in enumerate(pids):  # each actor's process started with the daemon's pipe directory
            environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in environ
            # the trainer's kernels at most 60% of the SMs, the engine's unlimited
            assert (b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60" in environ) == (i == 0)
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ
        assert "mps_s" in run.startup
        run.train(1)
        assert fake_daemon.read_text().count("command") == 0  # not quit while its clients run
    finally:
        run.close()
    assert fake_daemon.read_text().splitlines()[-1].startswith(f"command {pipe} quit")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


async def _pids(handles) -> list[int]:
    return [await h.ping() for h in handles]


@pytest.mark.gpu
def test_the_real_daemon_serves_a_cuda_client_and_quits(monkeypatch):
    if shutil.which(mps.CONTROL) is None:
        pytest.skip(f"{mps.CONTROL} is not installed")
    for var in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        monkeypatch.delenv(var, raising=False)
    daemon = MpsDaemon.start()
    try:
        client = subprocess.Popen([sys.executable, "-c", "import sys, torch; x = torch.ones(1, device='cuda'); "
                                   "print(float(x.sum())); sys.stdout.flush(); sys.stdin.read()"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "1.0"
        servers = daemon.command("get_server_list")
        assert servers.split() and all(p.isdigit() for p in servers.split())  # the client made a server start
        client.communicate("", timeout=60)
        assert client.returncode == 0
    finally:
        daemon.stop()


def test_a_run_saved_with_mps_resumes_without_it(monkeypatch, tmp_path):
    """A checkpoint of a run under MPS, resumed where there is no MPS: ``runtime.mps=false``
    is one of the keys a resume may change, and the saved config is not checked against
    this machine before the override applies."""
    from actors.config import load_resume_config, to_yaml

    monkeypatch.setenv("PATH", str(tmp_path))  # no control daemon here
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    saved = tmp_path / "config.yaml"
    text = to_yaml(load_config(ROOT / "fully_async.yaml", ["runtime.type=process"]))
    assert "\n  mps: false\n" in text
    saved.write_text(text.replace("\n  mps: false\n", "\n  mps: true\n", 1))
    assert not load_resume_config(saved, ["runtime.mps=false"]).runtime.mps
    with pytest.raises(ConfigError, match="^runtime.mps: "):  # kept on: checked, and refused here
        load_resume_config(saved)
