"""NVIDIA MPS for a run's actor processes (``runtime.mps``).

Without MPS, the CUDA contexts of two processes on one GPU take turns: a colocated
trainer's kernels and a generating engine's never run at once, and the trainer step
beside the engine takes about twice its time alone. Under MPS the actors' processes are
clients of one server and their kernels share the GPU's SMs, and the step comes close to
its time alone (``docs/benchmarks.md``).

    MpsDaemon.start()   a control daemon of the run's own (``nvidia-cuda-mps-control -d``,
                        pipe and log directories in a fresh temporary directory), and the
                        CUDA_MPS_* variables set in this process's environment, so every
                        actor process started after it is a client; returns the daemon
    daemon.stop()       ``quit`` to the daemon (its server ends once its clients have),
                        the variables as they were, the directory removed

``runtime.mps_trainer_sm_percent`` caps the share of SMs the trainer's kernels may take
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` in its processes' environment from their start):
unlimited, the engine's prefills ran several times slower beside it and fully-async lost
more than the trainer gained (``docs/benchmarks.md``).

A daemon the environment already names (``CUDA_MPS_PIPE_DIRECTORY`` set: the cluster's
own, or the user's) is used as it is, never started or stopped here. A client that
cannot reach the daemon runs without MPS, as CUDA does; the daemon's log
(``log_dir``) says what its server did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

__all__ = ["CONTROL", "MpsDaemon", "mps_unavailable", "restore_environ"]

CONTROL = "nvidia-cuda-mps-control"
_VARS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
_CONTROL_TIMEOUT_S = 30.0
QUIT_TIMEOUT_S = 10  # ``quit -t``: the daemon forces its server down after this long


def restore_environ(saved: dict[str, str | None]) -> None:
    """Put ``os.environ``'s variables back as ``saved`` holds them (None: unset)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def mps_unavailable() -> str | None:
    """Why ``runtime.mps`` cannot start a daemon here, or None."""
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or shutil.which(CONTROL):
        return None
    return f"{CONTROL} is not on PATH (it comes with the NVIDIA driver); set runtime.mps=false"


class MpsDaemon:
    """One MPS control daemon for a run (see the module docstring)."""

    def __init__(self, pipe_dir: str, log_dir: str, *, owned: bool, root: str | None = None,
                 saved: dict[str, str | None] | None = None) -> None:
        self.pipe_dir, self.log_dir, self.owned = pipe_dir, log_dir, owned
        self._root, self._saved = root, saved or {}

    @classmethod
    def start(cls) -> MpsDaemon:
        if pipe := os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):  # a daemon of someone else's: used as it is
            return cls(pipe, os.environ.get("CUDA_MPS_LOG_DIRECTORY", ""), owned=False)
        exe = shutil.which(CONTROL)
        if exe is None:
            raise RuntimeError(f"runtime.mps: {mps_unavailable()}")
        # short paths: the pipe directory holds unix sockets (at most 107 bytes a path)
        root = tempfile.mkdtemp(prefix="asyncrl-mps-")
        dirs = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
        for d in dirs.values():
            os.mkdir(d)
        try:
            done = subprocess.run([exe, "-d"], env={**os.environ, **dirs}, capture_output=True, text=True,
                                  timeout=_CONTROL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"runtime.mps: {CONTROL} -d did not start: {err}") from None
        if done.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            said = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(f"runtime.mps: {CONTROL} -d failed (exit {done.returncode})"
                               + (f": {said[-1]}" if said else ""))
        saved = {k: os.environ.get(k) for k in _VARS}
        os.environ.update(dirs)  # every process started from now on is a client of this daemon
        return cls(dirs["CUDA_MPS_PIPE_DIRECTORY"], dirs["CUDA_MPS_LOG_DIRECTORY"], owned=True, root=root,
                   saved=saved)

    def command(self, line: str) -> str:
        """Send one command (``get_server_list``, ...) to the daemon; its answer."""
        exe = shutil.which(CONTROL) or CONTROL
        done = subprocess.run([exe], input=line + "\n", env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir},
                              capture_output=True, text=True, timeout=_CONTROL_TIMEOUT_S)
        return done.stdout.strip()

    def stop(self) -> None:
        """End a daemon this run started (nothing for one it found). Call it after the
        actors' processes ended: the server waits for its clients, at most
        ``QUIT_TIMEOUT_S``. Best effort: a daemon that is gone already is fine."""
        if not self.owned:
            return
        self.owned = False
        restore_environ(self._saved)
        try:
            said = self.command(f"quit -t {QUIT_TIMEOUT_S}")
            if "invalid" in said.lower() or "unknown" in said.lower():  # a daemon too old for -t
                self.command("quit")
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
