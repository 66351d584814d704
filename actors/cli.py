"""The command line, ``python -m actors.launch`` (:func:`main`): arguments, one line
on stderr for every way a run stops, and the exit code saying which. SIGTERM /
SIGINT stop a run at the next step boundary with a checkpoint, or at once on a
second signal or when no boundary comes within ``run.stop_grace_s``
(:class:`_StopOnSignals`)."""

from __future__ import annotations

import _thread
import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import FrameType

from actors.config import ConfigError, checkpoint_every, load_config, to_yaml
from actors.resume import resume_config
from actors.run import Run
from actors.training import RunStopped
from policies.base import ActorLostError, NoProgressError
from policies.reward_guard import RewardsFailing
from sync.errors import SyncFailed

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m actors.launch",
        description="Run fully-async RL post-training from a YAML config.",
        epilog="Example: python -m actors.launch fully_async.yaml trainer.lr=2e-6 runtime.type=ray\n"
               "Every field of the config is documented where its section is declared (listed in actors/config.py).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="path to the YAML config (e.g. fully_async.yaml); not with --resume")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="dotted overrides applied after the file, e.g. trainer.lr=2e-6 runtime.type=local")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: run.total_steps)")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its newest whole checkpoint (or from the checkpoint "
                        "RUN_DIR/checkpoints/step-N named), with its own config; overrides of run.total_steps, "
                        "run.checkpoint_every, runtime.* and the like only")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, print its whole traceback (by default: one line naming what is wrong)")
    return p


# Errors that say what is wrong with the input or the machine in their message; any
# other type is named too (it is more likely a bug: --traceback shows where).
_USER_ERRORS = (ValueError, OSError, ImportError, RuntimeError)


def _error(err: BaseException, show_traceback: bool, then: str = "") -> None:
    """One line on stderr: ``error: <what is wrong>[; <then>]``."""
    if show_traceback:
        traceback.print_exception(err)
    what = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, _USER_ERRORS):
        what = f"{type(err).__name__}: {what}" + ("" if show_traceback else " (--traceback for where)")
    print(f"error: {what}" + (f"; {then}" if then else ""), file=sys.stderr)


def _resume_hint(run: Run) -> str:
    """How to go on after a run stopped on a lost actor or failing pushes."""
    if run.last_checkpoint is not None:
        return f"resume with: python -m actors.launch --resume {run.dir} (from {run.last_checkpoint.name})"
    every = checkpoint_every(run.cfg)
    return ("no checkpoint was written (run.checkpoint_every=0)" if not every
            else f"no checkpoint yet (run.checkpoint_every={every})")


class _StopNow(KeyboardInterrupt):
    """Stop at once, without a checkpoint: a second signal, the first one during
    setup, or no step boundary within ``run.stop_grace_s`` of the first. A
    KeyboardInterrupt, which the event loop lets out of a signal handler it runs."""

    def __init__(self, signum: int, why: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} {why}, without a checkpoint")
        self.signum = signum


class _StopOnSignals:
    """SIGTERM / SIGINT on the command line. The first is acknowledged on stderr at
    once and asks the run to stop after the step in progress, with a checkpoint
    (:class:`RunStopped`), or, during setup, once it is set up, before any step; a
    second one, or no such boundary within ``grace_s``, stops it at once
    (:class:`_StopNow`). While the run closes a signal ends the process. Handlers
    restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.run: Run | None = None  # set once the run is set up
        self.closing = False
        self.first: int | None = None  # the first signal's number
        self.forced: _StopNow | None = None  # a stop at once that cancelled the training task
        self._expired = False
        self._timer: threading.Timer | None = None
        self._old: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    @staticmethod
    def _say(line: str) -> None:
        os.write(2, (line + "\n").encode())  # not print(): the handler may interrupt a write to stderr

    def _expire(self) -> None:  # on the timer's thread: the handler runs on the main thread, as for a signal
        self._expired = True
        _thread.interrupt_main(self.first)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.closing:
            self._say(f"stopped by {name} while closing")
            os._exit(128 + signum)
        if self.first is not None:
            stop = _StopNow(self.first, f"(no step boundary within {self.grace_s:g} s, run.stop_grace_s)"
                            if self._expired else f"and then {name} again")
            call = self.run._train_call if self.run is not None else None
            if call is None or call.task is None:
                raise stop  # no training to stop (setup): the exception ends what runs now
            # training: its task is cancelled, not interrupted wherever the handler lands
            # (inside a coroutine's step, a KeyboardInterrupt would tear that task alone)
            self.forced = stop
            call.task.get_loop().call_soon_threadsafe(call.task.cancel)
            return
        self.first = signum
        when = ("once the run is set up, before its first step" if self.run is None
                else f"after step {self.run.policy.step + 1} with a checkpoint")
        self._say(f"{name}: stopping {when} (within {self.grace_s:g} s, run.stop_grace_s; {name} again stops at once)")
        if self.run is not None:
            self.run.request_stop(signum)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        """The run closes now: no more waiting for a step; a signal ends the process."""
        self.closing = True
        if self._timer is not None:
            self._timer.cancel()

    def __enter__(self) -> _StopOnSignals:
        self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        for s, handler in self._old.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 after a run, 2 when the config or the setup is wrong (no
    run directory is left behind), 1 when the run stops with an error, 128 + the
    signal's number when SIGTERM / SIGINT stopped it (with a checkpoint when the
    step in progress finished in time). Each stop is one line on stderr."""
    parser = _parser()
    args = parser.parse_intermixed_args(argv)  # options may come between overrides
    try:
        if args.resume is not None:
            overrides = list(args.overrides)
            if args.config is not None:
                if "=" not in args.config:
                    raise ConfigError(f"--resume continues with the run's own config; {args.config!r} is not a "
                                      "key.path=value override")
                overrides.insert(0, args.config)
            ckpt, cfg = resume_config(args.resume, overrides)
        else:
            if args.config is None:
                parser.error("the config file is required (or --resume RUN_DIR)")
            ckpt, cfg = None, load_config(args.config, args.overrides)
    except ValueError as err:  # ConfigError, or no checkpoint to resume from
        _error(err, args.traceback)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    with _StopOnSignals(cfg.run.stop_grace_s) as signals:
        try:
            run = Run(cfg, resume=ckpt)
        except _StopNow as err:
            print(str(err), file=sys.stderr)
            return 128 + err.signum
        except Exception as err:  # noqa: BLE001 - the command line's boundary: one line, not a traceback
            _error(err, args.traceback)
            return 2
        signals.run = run
        print(json.dumps({"run_dir": str(run.dir)}), flush=True)  # where to look while it runs
        try:
            with run:
                try:
                    if signals.first is not None:  # during setup: no step is started
                        raise _StopNow(signals.first, "during setup")
                    run.train(args.steps)
                except RunStopped as err:
                    print(str(err), file=sys.stderr)
                    run.stop_reason = str(err)
                    return 128 + err.signum
                except (_StopNow, asyncio.CancelledError) as cancelled:
                    if signals.forced is None and not isinstance(cancelled, _StopNow):
                        raise
                    err = signals.forced or cancelled
                    logging.getLogger("asyncio").disabled = True  # the tasks it abandons: no "never retrieved"
                    last = f"; the last checkpoint is {run.last_checkpoint}" if run.last_checkpoint else ""
                    print(f"{err}{last}", file=sys.stderr)
                    run.stop_reason = str(err)
                    return 128 + err.signum
                except (NoProgressError, ActorLostError, SyncFailed, RewardsFailing) as err:  # one line, as the others
                    _error(err, args.traceback, _resume_hint(run))
                    run.stop_reason = " ".join(str(err).split())
                    return 1
                finally:
                    signals.close()
        finally:
            signals.close()
    print(json.dumps({"summary": run.summary()}))
    return 0
