"""The bad-input battery of ``python -m actors.launch``: each case is one line on
stderr naming what is wrong, a non-zero exit, no traceback, and no run directory
(nor an output directory it would have made) left behind.

Most cases call ``main(argv)`` in this process (a subprocess costs ~2 s of imports
on 2 cores); three go through a real subprocess to show the process-level behaviour."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import time

import pytest

from actors.launch import main
from tests.helpers import free_port, silent_listener

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "fully_async.yaml")


def write(path: pathlib.Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def assert_refused(rc: int, err: str, out_dir: pathlib.Path, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not out_dir.exists(), sorted(p.name for p in out_dir.iterdir())


BAD_FILES = {
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)), "a binary file (NUL byte at offset 7)"),
    "binary_without_nul": (bytes(range(128, 256)) * 4, "not UTF-8 text (byte 0x80 at offset 0)"),
    "latin1": ("run:\n  name: café\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 16)"),
    "empty": (b"", "the config file is empty"),
    "comments_only": (b"# a config\n\n# nothing here\n", "the config file is empty"),
    "scalar": (b"just words\n", "expected a mapping of sections at the top level"),
    "deep": (b"[" * 5000, "malformed YAML"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_config_file_that_is_not_a_yaml_mapping_is_one_line(case, tmp_path, capsys):
    data, message = BAD_FILES[case]
    out = tmp_path / "runs"
    rc = main([write(tmp_path / f"{case}.yaml", data), f"run.output_dir={out}"])
    assert_refused(rc, capsys.readouterr().err, out, message, f"{case}.yaml")


IMPOSSIBLE = {
    "one_step_off_never_fresh": (["policy.type=one_step_off", "policy.max_staleness=0"],
                                 ["policy.max_staleness: 0 with policy.type=one_step_off"]),
    "window_older_than_bound": (["policy.trigger_parameter_sync_step=2", "policy.max_staleness=0"],
                                ["policy.max_staleness: 0 is below policy.trigger_parameter_sync_step - 1 = 1",
                                 "step 2 of each window finds every sample 1 version old"]),
    "long_window": (["policy.trigger_parameter_sync_step=5", "policy.max_staleness=2"],
                    ["policy.max_staleness >= 4 or policy.trigger_parameter_sync_step <= 3"]),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_a_schedule_that_can_never_train_is_refused_with_its_keys(case, tmp_path, capsys):
    overrides, messages = IMPOSSIBLE[case]
    out = tmp_path / "runs"
    rc = main([CONFIG, *overrides, f"run.output_dir={out}"])
    assert_refused(rc, capsys.readouterr().err, out, *messages)


TASKS = {
    "unknown_task": (["task.type=no_such_task"], ["task.type: unknown task 'no_such_task'; known tasks:"]),
    "unknown_option": (["task.kwargs.colour=1"], ["task.kwargs: bad options for task 'reverse_digits'", "colour"]),
    "missing_option": (["task.type=text_dataset"], ["task.kwargs: task 'text_dataset' needs one source of rows: path"]),
    # found only when the task is built, after the run directory exists: it is removed again
    "missing_data_file": (["task.type=text_dataset", "task.kwargs.path=/nonexistent/train.jsonl"],
                          ["/nonexistent/train.jsonl", "no such file"]),
}


@pytest.mark.parametrize("case", sorted(TASKS))
def test_a_task_that_cannot_be_built_is_one_line_and_leaves_no_run_directory(case, tmp_path, capsys):
    overrides, messages = TASKS[case]
    out = tmp_path / "deeper" / "runs"  # the parents it would make go too
    rc = main([CONFIG, *overrides, f"run.output_dir={out}", "run.progress=false"])
    assert_refused(rc, capsys.readouterr().err, tmp_path / "deeper", *messages)


@pytest.mark.parametrize(("override", "key", "package"), [
    ("rollout.engine.type=vllm", "rollout.engine.type", "vllm"),
    ("trainer.backend=megatron", "trainer.backend", "megatron"),
])
def test_an_engine_or_backend_that_is_not_installed_is_one_line(override, key, package, tmp_path, capsys):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    out = tmp_path / "runs"
    rc = main([CONFIG, override, f"run.output_dir={out}"])
    assert_refused(rc, capsys.readouterr().err, out, f"{key}: ", "not installed")


def test_a_ray_address_that_refuses_connections_is_one_line_at_once(tmp_path, capsys):
    """``ray.init`` would retry a dead address for minutes: the runtime probes it first."""
    port = free_port()
    out = tmp_path / "runs"
    rc = main([CONFIG, "runtime.type=ray", f"runtime.address=127.0.0.1:{port}", f"run.output_dir={out}",
               "run.progress=false"])
    assert_refused(rc, capsys.readouterr().err, out, f"runtime.address: no Ray cluster answers at 127.0.0.1:{port}")


def test_a_ray_address_that_accepts_but_never_answers_is_one_line_within_the_timeout(tmp_path, capsys):
    """``ray.init`` would wait on it for over 5 minutes: the runtime's probe (an HTTP/2
    preface a Ray GCS answers at once) gives up after ``runtime.connect_timeout_s``."""
    import ray

    out = tmp_path / "runs"
    with silent_listener() as listener:
        port = listener.getsockname()[1]
        start = time.monotonic()
        rc = main([CONFIG, "runtime.type=ray", f"runtime.address=127.0.0.1:{port}", "runtime.connect_timeout_s=0.5",
                   f"run.output_dir={out}", "run.progress=false"])
        took = time.monotonic() - start
    assert_refused(rc, capsys.readouterr().err, out,
                   f"runtime.address: 127.0.0.1:{port} accepted a connection but did not answer within 0.5 s "
                   "(runtime.connect_timeout_s); check that the head node is up")
    assert took < 15, took  # the setup before the runtime (task, tokenizer) and the 0.5 s probe
    assert not ray.is_initialized()  # ray.init never ran: no cluster started, none joined


@pytest.mark.parametrize(("ray_address_env", "messages"), [
    (None, ["runtime.address=auto: no running Ray cluster found on this machine", "`ray start --head`"]),
    ("local", ["runtime.address=auto: RAY_ADDRESS=local asks Ray to start a new cluster, not to join one"]),
])
def test_auto_with_no_cluster_to_join_is_one_line_and_starts_none(ray_address_env, messages, no_ray_cluster_here,
                                                                  tmp_path, capsys, monkeypatch):
    import ray

    if ray_address_env is not None:
        monkeypatch.setenv("RAY_ADDRESS", ray_address_env)
    out = tmp_path / "runs"
    rc = main([CONFIG, "runtime.type=ray", "runtime.address=auto", "runtime.connect_timeout_s=1",
               f"run.output_dir={out}", "run.progress=false"])
    assert_refused(rc, capsys.readouterr().err, out, *messages)
    assert not ray.is_initialized()  # asked to join one: no local cluster was started instead


@pytest.mark.parametrize(("override", "message"), [
    ("runtime.connect_timeout_s=0", "runtime.connect_timeout_s: "),
    ("runtime.connect_timeout_s=soon", "runtime.connect_timeout_s: expected float"),
    ("runtime.address=headnode", "runtime.address: expected auto, host:port or ray://host:port"),
    ("runtime.address=127.0.0.1:70000", "runtime.address: expected auto, host:port or ray://host:port"),
    ("runtime.address=local", "runtime.address: expected auto, host:port or ray://host:port"),
])
def test_a_malformed_cluster_setting_is_refused_at_load(override, message, tmp_path, capsys):
    out = tmp_path / "runs"
    rc = main([CONFIG, "runtime.type=ray", override, f"run.output_dir={out}"])
    assert_refused(rc, capsys.readouterr().err, out, message)


def test_an_internal_error_during_setup_is_one_line_naming_its_type(tmp_path, capsys, monkeypatch):
    """Not a user error: its type is named and --traceback shows where."""
    import policies.tasks

    def broken(*args, **kwargs):
        raise KeyError("vocab")

    monkeypatch.setattr(policies.tasks, "make_task", broken)
    out = tmp_path / "runs"
    rc = main([CONFIG, f"run.output_dir={out}", "run.progress=false"])
    assert_refused(rc, capsys.readouterr().err, out, "error: KeyError: 'vocab' (--traceback for where)")
    rc = main([CONFIG, f"run.output_dir={out}", "run.progress=false", "--traceback"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1] == "error: KeyError: 'vocab'"
    assert not out.exists()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actors.launch", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("case", ["binary", "ray_refused", "ray_silent", "missing_data_file"])
def test_the_cli_process_exits_non_zero_with_one_line_and_no_traceback(case, tmp_path):
    out = tmp_path / "runs"
    listener = silent_listener()  # used by ray_silent; the others ignore it
    if case == "binary":
        args = [write(tmp_path / "model.bin", b"\x00\x01\x02garbage"), f"run.output_dir={out}"]
        needle = "a binary file (NUL byte at offset 0), not a YAML config"
    elif case == "ray_refused":
        port = free_port()
        args = [CONFIG, "runtime.type=ray", f"runtime.address=127.0.0.1:{port}", f"run.output_dir={out}"]
        needle = f"runtime.address: no Ray cluster answers at 127.0.0.1:{port} (Connection refused)"
    elif case == "ray_silent":
        port = listener.getsockname()[1]
        args = [CONFIG, "runtime.type=ray", f"runtime.address=127.0.0.1:{port}", "runtime.connect_timeout_s=1",
                f"run.output_dir={out}"]
        needle = f"runtime.address: 127.0.0.1:{port} accepted a connection but did not answer within 1 s"
    else:
        args = [CONFIG, "task.type=text_dataset", "task.kwargs.path=/nonexistent/train.jsonl", f"run.output_dir={out}"]
        needle = "/nonexistent/train.jsonl"
    with listener:
        res = run_cli(*args)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()], res.stderr
    assert res.stderr.startswith("error: ") and needle in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""
    assert not out.exists()


@pytest.mark.parametrize("every", [0, 1])
def test_a_run_that_loses_an_actor_ends_in_one_line_saying_how_to_go_on(every, tmp_path, capsys, monkeypatch):
    """Exit 1 and one line: the error, then the command that resumes from the last
    checkpoint, or that none was written."""
    from actors.launch import Run
    from policies.base import ActorLostError

    real = Run.train

    def train_then_lose(self, steps=None):
        real(self, 2)
        raise ActorLostError("the trainer died during step 3 (test)")

    monkeypatch.setattr(Run, "train", train_then_lose)
    out = tmp_path / "runs"
    rc = main([CONFIG, f"run.output_dir={out}", "run.progress=false", f"run.checkpoint_every={every}",
               "trainer.batch_prompts=2", "rollout.n=4"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: the trainer died during step 3 (test); ")
    (run_dir,) = out.iterdir()
    if every:
        assert lines[0].endswith(f"; resume with: python -m actors.launch --resume {run_dir} (from step-000002)")
    else:
        assert lines[0].endswith("; no checkpoint was written (run.checkpoint_every=0)")
