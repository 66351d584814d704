"""The training loop of a :class:`~actors.run.Run`: ``train`` (blocking: notebooks
and the command line), ``train_async`` (code on an event loop), and the ways a
train call ends early. An interrupt (a KeyboardInterrupt, a notebook's stop button,
a cancelled ``train_async``) ends it at the next step boundary, and the run can
train again at once; a stop request (the command line's SIGTERM / SIGINT) writes a
checkpoint after the step in progress and raises :class:`RunStopped`; a step that
does not finish within ``run.watchdog_s`` raises ``NoProgressError``."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import signal
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

import loop
from actors import notebook
from actors.config import Config, checkpoint_every
from actors.loggers import sample_rows
from policies.base import NoProgressError

if TYPE_CHECKING:
    from tqdm import tqdm

    from actors.loggers import MetricsLog
    from policies.base import PolicyBase

R = TypeVar("R")

__all__ = ["RunStopped", "TrainCall", "Training"]

log = logging.getLogger(__name__)


class RunStopped(RuntimeError):
    """The run stopped on a signal (SIGTERM, SIGINT) after writing a checkpoint."""

    def __init__(self, signum: int, step: int, path: pathlib.Path, run_dir: pathlib.Path) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint {path} "
                         f"(continue with: python -m actors.launch --resume {run_dir})")
        self.signum, self.step, self.checkpoint = signum, step, path


class TrainCall:
    """One train call's stop request: set from any thread (a KeyboardInterrupt in
    the caller's, a cancelled ``train_async``), read at the call's step boundaries.
    Per call, so a request that arrives late never stops the next call."""

    def __init__(self) -> None:
        self.interrupted = False
        self.task: asyncio.Task[object] | None = None  # on the run's loop, once it runs

    def interrupt(self) -> None:
        self.interrupted = True


_WAKE_S = 0.1  # how often train_async's caller wakes while it waits
_WAITING_EVERY_S = 1.0  # how often the progress bar says what a step waits for


class Training:
    """The part of :class:`~actors.run.Run` that trains it. Uses the run's ``cfg``,
    ``policy``, ``dir``, ``_metrics_file``, its ``_checkpoint`` (``actors/resume.py``)
    and the state below, which the run's constructor sets."""

    cfg: Config
    policy: PolicyBase
    dir: pathlib.Path
    history: list[dict[str, object]]
    initial_eval: dict[str, object] | None
    resumed_from: pathlib.Path | None
    _drafts_seen: tuple[int, int] = (0, 0)  # (drafted, accepted) at the last step: _draft_acceptance
    last_checkpoint: pathlib.Path | None
    _metrics_file: MetricsLog
    _resume_step: int
    _stop_signal: int | None
    _train_call: TrainCall | None
    _closed: bool
    _train_failed: bool  # a train call ended on an error (the run saves no final checkpoint)
    startup: dict[str, float]  # startup phases, seconds; closed by the first step (_close_startup)
    startup_actors: dict[str, dict[str, float]]  # each actor's start by part, inside startup's actors_s
    _t_startup: float  # perf_counter at the start of the run's construction
    _t_constructed: float  # ... and at its end
    weight_transport: str  # the weight link's transport and what it pushes after the first full push
    weight_mode: str

    def train(self, steps: int | None = None) -> notebook.TrainResult:
        """Run ``steps`` more trainer steps (default: the rest of ``run.total_steps``;
        more than the rest raises ``run.total_steps`` to match, with a one-line notice);
        returns their records, a list whose repr is one line (:class:`~actors.notebook.TrainResult`).
        Blocks; in code already on an event loop use :meth:`train_async`. A
        KeyboardInterrupt (Ctrl-C, a notebook's stop button) stops training at the next
        step boundary (:meth:`interrupt`), then is raised: the run can train again at once."""
        steps = self._steps(steps)
        if loop.in_loop():
            raise RuntimeError("run.train() would block the loop the run lives on: `await run.train_async(steps)`")
        if self._train_call is None:  # a second call at once is refused: it must not move the budget
            notebook.extend_total_steps(self.cfg.run, self.policy.step, steps)
        call, t0 = TrainCall(), time.perf_counter()
        try:
            records = loop.run(self._train_alone(steps, call), on_interrupt=call.interrupt)
        except KeyboardInterrupt:
            if not call.interrupted:  # raised by a SIGINT handler of the caller's own, mid-step
                raise
            raise KeyboardInterrupt(f"training stopped after step {self.policy.step}; the run can train again") from None
        return notebook.TrainResult(records, total_steps=self.cfg.run.total_steps, wall_s=time.perf_counter() - t0)

    async def train_async(self, steps: int | None = None) -> notebook.TrainResult:
        """:meth:`train` for code on an event loop (a notebook cell with ``await``):
        the steps run on the run's loop (the caller's own, or a background thread's).
        Cancelling it (a notebook's stop button cancels the cell) stops training at
        the next step boundary as an interrupt does, then CancelledError propagates."""
        steps = self._steps(steps)
        if self._train_call is None:  # a second call at once is refused: it must not move the budget
            notebook.extend_total_steps(self.cfg.run, self.policy.step, steps)
        call, t0 = TrainCall(), time.perf_counter()
        work = self._train_alone(steps, call)
        if loop.in_loop():
            running: asyncio.Future[list[dict[str, object]]] = asyncio.ensure_future(work)
        else:
            running = asyncio.wrap_future(loop.submit(work))
        try:  # a cancel reaches this wait only, never a step (asyncio.wait leaves ``running`` be)
            while not running.done():
                # wake now and then: Jupyter's stop button cancels this task from a signal
                # handler that does not wake the loop (ipykernel 7 on tornado)
                await asyncio.wait([running], timeout=_WAKE_S)
        except asyncio.CancelledError:
            call.interrupt()
            while not running.done():
                try:
                    await asyncio.wait([running])
                except asyncio.CancelledError:  # cancelled again: the step in progress still ends first
                    pass
            if not running.cancelled() and running.exception() is not None:
                raise running.exception() from None
            raise asyncio.CancelledError(f"training stopped after step {self.policy.step}; the run can train "
                                         "again") from None
        return notebook.TrainResult(running.result(), total_steps=self.cfg.run.total_steps,
                                    wall_s=time.perf_counter() - t0)

    def interrupt(self) -> None:
        """Stop the train call in progress at the next step boundary: the step being
        taken finishes (its push too: no engine is left paused), its record is
        written, and the call ends. Safe from any thread and from a signal handler;
        a no-op between calls."""
        call = self._train_call
        if call is not None:
            call.interrupt()

    def _steps(self, steps: int | None) -> int:
        if self._closed:
            raise RuntimeError("this run is closed")
        remaining = self.cfg.run.total_steps - self.policy.step
        return max(0, remaining) if steps is None else steps

    async def _train_alone(self, steps: int, call: TrainCall) -> list[dict[str, object]]:
        """:meth:`_train` as ``call``, one call at a time (two would step one trainer at once)."""
        if self._train_call is not None:
            raise RuntimeError("this run is training already (one train call at a time; run.interrupt() stops it)")
        self._train_call, call.task = call, asyncio.current_task()
        try:
            return await self._train(steps, call)
        except BaseException as err:
            if not isinstance(err, RunStopped):  # RunStopped wrote its checkpoint
                self._train_failed = True
            raise
        finally:
            self._train_call = None

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop after the step in progress: write a checkpoint, then ``train``
        raises :class:`RunStopped` naming it (the command line's SIGTERM / SIGINT)."""
        self._stop_signal = signum

    async def _train(self, steps: int, call: TrainCall) -> list[dict[str, object]]:
        t_call = time.perf_counter()
        bar = None
        if self.cfg.run.progress:
            bar = notebook.progress_bar(total=len(self.history) + steps, initial=len(self.history))
        out: list[dict[str, object]] = []
        unwritten: list[dict[str, object]] = []  # steps' records not final yet (a push or an evaluation runs on)
        if self.cfg.policy.eval_every and self.initial_eval is None:  # the baseline: weights before step 1,
            # evaluated beside the first steps (their pushes wait for it); written first, once it is in
            t0 = time.perf_counter()
            self.initial_eval = {"step": 0}
            await self.policy.evaluate_beside(self.initial_eval)
            unwritten.append(self.initial_eval)
            if "total_s" not in self.startup:  # what the first step waited for it: starting it
                self.startup["initial_eval_s"] = time.perf_counter() - t0
        every = checkpoint_every(self.cfg)
        try:
            for _ in range(steps):
                if call.interrupted:  # a step boundary: nothing of this call runs on after it
                    break
                t_step = time.perf_counter()
                waiting = asyncio.ensure_future(self._show_waiting(bar)) if bar is not None else None
                try:
                    (m,) = await self._watched(self.policy.train(1))
                finally:
                    if waiting is not None:
                        waiting.cancel()
                        await asyncio.gather(waiting, return_exceptions=True)
                        bar.set_description_str("", refresh=False)
                if self.cfg.rollout.engine.speculative != "off":
                    m.update(await self._draft_acceptance())
                if self.policy.examples:  # run.log_samples_every: a few completions to read
                    rows = sample_rows(m["step"], self.policy.examples[:self.cfg.run.log_samples],
                                       getattr(self.policy.task, "tokenizer", None))
                    self._metrics_file.write_samples(rows)
                if "total_s" not in self.startup:
                    self._close_startup(m, t_call, t_step)
                if self.resumed_from is not None and m["step"] == self._resume_step + 1:
                    m["resumed_from"] = str(self.resumed_from.relative_to(self.dir))
                # a record is final once its push and evaluation (if still running) filled it in
                while unwritten and self.policy.settled(unwritten[0]["step"]):
                    self._metrics_file.write(json.dumps(unwritten.pop(0)) + "\n")
                unwritten.append(m)
                self.history.append(m)
                out.append(m)
                if self._stop_signal is not None or (every and m["step"] % every == 0):
                    await self.policy.settle()  # the checkpoint holds the pushed weights' version
                    while unwritten:
                        self._metrics_file.write(json.dumps(unwritten.pop(0)) + "\n")
                    await self._checkpoint()
                    if self._stop_signal is not None:
                        assert self.last_checkpoint is not None
                        raise RunStopped(self._stop_signal, m["step"], self.last_checkpoint, self.dir)
                if bar is not None:
                    bar.set_postfix(reward=f"{m['reward']:.3f}", stale=f"{m['staleness_mean']:.2f}",
                                    sps=f"{m['samples_per_s']:.1f}", refresh=False)
                    bar.update(1)
            await self.policy.settle()  # the last push ends before this loop stops
        finally:
            for record in unwritten:
                self._metrics_file.write(json.dumps(record) + "\n")
            if bar is not None:
                bar.close()
        return out

    async def _draft_acceptance(self) -> dict[str, float]:
        """``spec/acceptance``: the share of the draft tokens the engines proposed since the
        last step that they accepted (a draft that lags the policy shows here first);
        ``spec/acceptance_total``: since the start. Counters that went back (an actor
        respawned) count from zero."""
        try:
            stats = await asyncio.gather(*(h.statistics() for h in self.policy.rollouts))
        except Exception:  # noqa: BLE001 - an actor lost meanwhile: the policy reports it
            return {}
        (drafted, accepted), (drafted0, accepted0) = notebook.draft_counts(stats), self._drafts_seen
        if drafted < drafted0 or accepted < accepted0:
            drafted0 = accepted0 = 0
        self._drafts_seen = (drafted, accepted)
        out = {"spec/acceptance_total": accepted / drafted} if drafted else {}
        if drafted > drafted0:
            out["spec/acceptance"] = (accepted - accepted0) / (drafted - drafted0)
        return out

    async def _show_waiting(self, bar: tqdm) -> None:
        """While a step runs, say on ``bar`` every second what it waits for (the
        samples being scored, or generation): a slow step is never a still bar."""
        while True:
            await asyncio.sleep(_WAITING_EVERY_S)
            try:
                stats = await asyncio.gather(*(h.statistics() for h in self.policy.rollouts))
            except Exception:  # noqa: BLE001 - an actor lost meanwhile: the policy reports it, not the bar
                continue
            bar.set_description_str(notebook.waiting_for(stats))

    def _close_startup(self, record: dict[str, object], t_call: float, t_step: float) -> None:
        """The run's first trained step: ``startup`` gets ``before_train_s`` (from the end of
        construction to the train call that took it: the caller's own work, e.g. an evaluation),
        ``first_step_s`` (its first batch generated and trained) and ``total_s`` (from the
        start of construction to now; the phases are disjoint spans of it, so they sum to at
        most it), and goes into the step's record as ``startup/<phase>``, with the weight link's
        ``startup/sync_transport`` and ``startup/sync_mode`` (what ``sync.mode`` became); logged once."""
        now = time.perf_counter()
        self.startup.update(before_train_s=t_call - self._t_constructed, first_step_s=now - t_step,
                            total_s=now - self._t_startup)
        record.update({f"startup/{k}": round(v, 4) for k, v in self.startup.items()})
        record.update({f"startup/{actor}/{k}": v for actor, parts in self.startup_actors.items()
                       for k, v in parts.items()})
        record.update({"startup/sync_transport": self.weight_transport, "startup/sync_mode": self.weight_mode})
        log.info("weight sync: %s pushes over %s (sync.mode: %s)", self.weight_mode, self.weight_transport,
                 self.cfg.sync.mode)
        log.info("startup: %.2f s to the first trained step (%s)", self.startup["total_s"],
                 ", ".join(f"{k} {v:.2f}" for k, v in self.startup.items() if k != "total_s"))
        for actor, parts in self.startup_actors.items():
            log.info("startup of %s: %s", actor, ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))

    async def _watched(self, step: Awaitable[R]) -> R:
        """Await one trainer step; past ``run.watchdog_s`` stop it and raise
        ``NoProgressError`` with what each part of the run was waiting on."""
        limit = self.cfg.run.watchdog_s
        if not limit:
            return await step
        task = asyncio.ensure_future(step)
        done, _ = await asyncio.wait([task], timeout=limit)
        if done:
            return task.result()
        waiting = await self.policy.waiting_on()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise NoProgressError(f"no trainer step finished in {limit:g} s (run.watchdog_s): {waiting}")
