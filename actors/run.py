"""A live run (:class:`Run`): actors placed, queue open, policy ready. Its
constructor creates the run directory (removed again, with everything started,
when setup fails), composes the run and, when resuming, restores it; ``close``
stops it and writes ``summary.json``. What it does in between is split by
concern, one part each, of which :class:`Run` is made:

    actors/wiring.py         building the runtime, queue, actors and policy from the config
    actors/training.py       the training loop: train, train_async, interrupt, stop requests
    actors/resume.py         checkpoints of the run, and resuming from one
    actors/notebook_api.py   summary, repr, metrics, plot, check, export_hf
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import pathlib
import shutil
import sys
import threading
import time
from typing import TYPE_CHECKING

import loop
from actors.config import Config, config_warnings, to_yaml
from actors.loggers import open_metrics_log
from actors.notebook_api import NotebookAPI
from actors.resume import Checkpointing
from actors.training import TrainCall, Training
from actors.wiring import Wiring

if TYPE_CHECKING:
    from actors.loggers import MetricsLog
    from actors.runtime import Runtime
    from policies.base import PolicyBase
    from transfer_queue import TransferQueue

__all__ = ["Run"]

log = logging.getLogger(__name__)

_CLOSE_TRAIN_WAIT_S = 10.0  # close() lets a train call still running end its step this long, then cancels it

_open_runs: list[Run] = []  # set up and not closed yet: closed at exit (_close_at_exit)
_exit_hook_lock = threading.Lock()
_exit_hook = False


def _close_at_exit() -> None:
    """Close the runs a script left open (it never called ``close()``, or raised
    past it) as the interpreter ends, before it joins the actors' threads: their
    actors stop, ``summary.json`` says how the run ended, and the process exits
    with Python's own code instead of aborting on threads still running."""
    raised = getattr(sys, "last_value", None)  # the uncaught exception Python just printed, if any
    for run in list(_open_runs):
        if run.stop_reason is None:
            run.stop_reason = ("closed at exit: the script ended without run.close()" if raised is None else
                               f"closed at exit after the script raised {type(raised).__name__}: "
                               + " ".join(str(raised).split()))
        try:
            run.close()
        except Exception as err:  # noqa: BLE001 - at exit: one line, and the other runs still close
            print(f"asyncrl: closing {run.dir} at exit failed: {type(err).__name__}: {err}", file=sys.stderr)


def _track(run: Run) -> None:
    """Close ``run`` at exit unless it is closed before (see :func:`_close_at_exit`)."""
    global _exit_hook
    with _exit_hook_lock:
        if not _exit_hook:
            # before the interpreter joins non-daemon threads (an actor's worker), as
            # concurrent.futures' own exit hook, registered earlier, runs after this one
            threading._register_atexit(_close_at_exit)
            _exit_hook = True
    _open_runs.append(run)


class Run(Wiring, Training, Checkpointing, NotebookAPI):
    """A live run: actors placed, queue open, policy ready. Methods are
    synchronous (they drive the process's one loop) so notebooks can call them."""

    def __init__(self, cfg: Config, *, resume: pathlib.Path | None = None,
                 task_data: dict[str, object] | None = None) -> None:
        """``resume``: a whole checkpoint (``checkpoint.find``) whose config ``cfg``
        is (``load_resume_config``); ``launch(resume=...)`` finds both. ``task_data``:
        task options no config file can hold (``launch(data=...)``)."""
        # startup phases, seconds (``Wiring._setup``, ``Training._train``): the clock starts here
        self.startup: dict[str, float] = {}
        self.startup_actors: dict[str, dict[str, float]] = {}  # inside actors_s: each actor's parts
        self._t_startup = time.perf_counter()
        self._task_data = dict(task_data or {})
        from actors.models import check_model_files, resolve_model_path  # ~1.7 s to import (transformers)

        self.cfg = cfg
        for warning in config_warnings(cfg):
            log.warning(warning)
        # a wrong model path, or a corrupt file in it, fails before anything is created on disk
        self.model_path = str(resolve_model_path(cfg.model.path, cfg.base_dir))
        check_model_files(self.model_path)
        self.resumed_from = resume
        self._resume_step = 0  # the step of the checkpoint resumed from
        if resume is None:
            made = self._make_dir()  # what this run created on disk: removed again if setup fails
            (self.dir / "config.yaml").write_text(to_yaml(cfg))
        else:
            self.dir, made = resume.parents[1], []  # an existing run: nothing is removed if setup fails
        self.history: list[dict[str, object]] = []
        self._metrics_file: MetricsLog | None = None
        self.last_checkpoint: pathlib.Path | None = None
        self._stop_signal: int | None = None  # set by request_stop: checkpoint after this step, then stop
        self._train_call: TrainCall | None = None  # the train call in progress (interrupt stops it)
        self._closed = False
        self._train_failed = False  # a train call ended on an error: no final checkpoint at close
        self._discarded = False  # setup failed: no summary, the run directory removed
        self.stop_reason: str | None = None  # the line a run stopped early with, kept in summary.json
        self.runtime: Runtime | None = None
        self.mps = None
        self.policy: PolicyBase | None = None
        self.queue: TransferQueue | None = None
        self.weight_transport = ""  # chosen by placement at setup (sync.link.choose_transport)
        self.weight_mode = ""  # full or delta over it after the first push (sync.mode; auto: sync.auto.mode_for)
        self.initial_eval: dict[str, object] | None = None  # held-out eval before the first step (policy.eval_every)
        try:
            self.startup["config_s"] = time.perf_counter() - self._t_startup  # transformers import, run dir
            loop.run(self._setup())
            if resume is not None:
                t0 = time.perf_counter()
                loop.run(self._restore(resume))
                self.startup["restore_s"] = time.perf_counter() - t0
            # metrics.jsonl and the run.loggers mirroring it (actors/loggers.py)
            self._metrics_file = open_metrics_log(self.dir, cfg.run,
                                                  resume_step=None if resume is None else self._resume_step)
            self._t_constructed = time.perf_counter()
            _track(self)
        except BaseException:
            self._discard(made)
            raise

    def _make_dir(self) -> list[pathlib.Path]:
        """Create ``self.dir`` (a new one: a second run in the same second gets a suffix);
        returns the directories created, deepest first."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"{self.cfg.run.name}-{stamp}-{os.getpid()}"
        out = pathlib.Path(self.cfg.run.output_dir)
        for i in itertools.count():
            self.dir = out / (name if i == 0 else f"{name}-{i}")
            made = [d for d in (self.dir, *self.dir.parents) if not d.exists()]
            try:
                self.dir.mkdir(parents=True)
                return made
            except FileExistsError:
                continue
        raise AssertionError("unreachable")

    def _discard(self, made: list[pathlib.Path]) -> None:
        """Setup failed: stop what was started and remove what this run created on
        disk (its directory, and parents it made that are left empty). Nothing ran."""
        self._discarded = True
        self._end_setup_status()
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the setup error is the one to report; this one would hide it
            pass
        if not made:  # resuming: the run directory is not ours to remove
            return
        shutil.rmtree(self.dir, ignore_errors=True)
        for d in made[1:]:
            try:
                d.rmdir()  # only while empty
            except OSError:
                break

    def close(self) -> None:
        """Stop the policy, close the queue and the actors (and a Ray cluster we started)."""
        if self._closed:
            return
        self._closed = True
        if self in _open_runs:
            _open_runs.remove(self)

        async def _close() -> None:
            call = self._train_call
            if call is not None and call.task is not None:  # its caller went away: it ends after its step
                call.interrupt()
                wait_s = 0 if self.stop_reason else _CLOSE_TRAIN_WAIT_S  # stopped early: no step to wait for
                if not (await asyncio.wait([call.task], timeout=wait_s))[0]:
                    call.task.cancel()
                await asyncio.gather(call.task, return_exceptions=True)
            if not self._discarded and not self.stop_reason:
                try:
                    final = await self._save_final()  # actors.export and actors.evaluate read it
                except Exception as err:  # noqa: BLE001 - the run still closes; its last checkpoint stands
                    print(f"warning: no final checkpoint ({type(err).__name__}: {' '.join(str(err).split())}); "
                          f"the last one is {self.last_checkpoint}", file=sys.stderr)
                else:
                    if final is not None:
                        log.info("final checkpoint: %s", final)
            if self.policy is not None:
                await self.policy.close()
            if self.queue is not None:
                await self.queue.shutdown()
            if self.runtime is not None:
                await self.runtime.shutdown()

        try:
            loop.run(_close())
        finally:
            if self.mps is not None:  # its clients, the actors' processes, have ended
                self.mps.stop()
            if self._metrics_file is not None:
                self._metrics_file.close()
            if not self._discarded:
                stopped = {"stopped": self.stop_reason} if self.stop_reason else {}
                (self.dir / "summary.json").write_text(json.dumps({**self.summary(), **stopped}, indent=1))

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
