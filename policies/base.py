"""What every schedule shares: prompt groups, accounting, trainer steps, weight syncs, metrics.

The policy drives the actors with control messages only: a group request to
a rollout actor (which queues the finished samples itself and reports
counts), a batch request to the trainer (which takes its batch from the
TransferQueue, trains, acks and reports counts), sync triggers. Sample and
weight payloads never pass through it.

The sample counters, the accounting identity they must satisfy after every
step and what a checkpoint keeps of them are in :mod:`policies.accounting`;
the watchdog's report of a stuck step in :mod:`policies.watchdog`.

Faults (each keeps the accounting identity):

- a rollout actor that dies (its ``ping`` fails) leaves ``rollouts``: the
  schedule (every one: fully-async and the baselines) counts its unreported
  groups dropped (``actor_died``, :meth:`lost_group`), the weight
  broadcast group is re-formed without it before the next push, and the run
  goes on with the others. Up to ``rollout.max_respawns`` times a new actor
  replaces it (``respawn_rollout``, from the composition root): set up beside
  the others, it joins at the next push, which sends the trainer's weights in
  full (an engine not at a delta's base gets the full update); with no actor
  left the trainer is waiting for samples only a replacement can make, so it
  joins at once (:meth:`join_replacements`). With none left and none coming
  the run stops with :class:`ActorLostError`;
- a trainer that dies mid-step: the batch it leased goes back to the queue at
  once (its lease is expired) and the run stops with :class:`ActorLostError`;
- a weight push that fails (``SyncFailed``: the engines stay on, or were put
  back on, their version) is counted in its step's record (``sync/failed``)
  and the next push brings every engine to the trainer's version; after
  ``MAX_FAILED_PUSHES`` failures in a row the run stops with the last one.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import random
import time

from contracts.handles import RolloutHandle, TrainerHandle
from contracts.rollout import GroupRequest
from contracts.sample import Sample
from contracts.training import BatchRequest, StepReport
from policies.accounting import Accounting, AccountingError
from policies.config import RunSettings
from policies.faults import (ACTOR_DIED, MAX_FAILED_PUSHES, ActorLostError, Respawn, RolloutFaults, is_dead,
                             one_line)
from policies.reward_guard import RewardGuard
from policies.task_base import Task
from policies.watchdog import NoProgressError, WaitingReport
from sync.link import WeightSync
from transfer_queue import TransferQueue

__all__ = ["ACTOR_DIED", "MAX_FAILED_PUSHES", "PolicyBase", "AccountingError", "ActorLostError", "NoProgressError",
           "is_dead"]

log = logging.getLogger(__name__)

FLOW_CHECK_S = 1.0  # while a trainer step waits for its batch, the accounting's flow terms are checked this often


class PolicyBase(Accounting, WaitingReport, RolloutFaults, abc.ABC):
    """Shared machinery; subclasses decide *when* rollout, training and sync happen."""

    consumer = "trainer"

    def __init__(self, cfg: RunSettings, *, rollouts: list[RolloutHandle], trainer: TrainerHandle,
                 queue: TransferQueue, task: Task, weight_sync: WeightSync,
                 respawn_rollout: Respawn | None = None) -> None:
        self.cfg, self.rollouts, self.trainer, self.queue, self.task = cfg, rollouts, trainer, queue, task
        # (rollouts, trainer, released=None) -> the push's result (its metrics); sets ``released``
        # (an asyncio.Event) once the trainer may step again (see sync.link.push_weights)
        self.weight_sync = weight_sync
        self.rng = random.Random(cfg.run.seed)
        self.step = 0  # trainer steps done == trainer weight version
        self.trained = 0
        self._init_accounting()
        self._in_flight = 0
        self.admitted = 0  # samples ever sent to rollout (in flight, reported or not)
        self._t_rollout_busy_s = 0.0
        self._t_busy_since = 0.0
        self._t_start = time.perf_counter()
        self._t_trainer_busy_s = 0.0
        self.last_sync: dict[str, object] = {}  # a finished sync whose step has no record yet
        self._record: tuple[int, dict[str, object]] | None = None  # (step, metrics) of the latest step
        self._eval: tuple[int, asyncio.Task[None]] | None = None  # an evaluation beside training: its step, task
        self.examples: list[Sample] = []  # a few samples of the latest step (``run.log_samples``), or none
        self._init_faults(respawn_rollout)
        reward = cfg.task.kwargs.get("reward")
        self.reward_guard = RewardGuard(
            name=repr(reward) if reward else f"of task {cfg.task.type!r}", max_share=cfg.policy.max_reward_error_share,
            window=cfg.policy.reward_error_window, min_samples=2 * cfg.rollout.n)
        self.num_groups = 0  # prompt groups named by this run (ids g0, g1, ...)
        self._group_base = 0  # ... and before the checkpoint it resumed from (its ids go on after those)
        self._init_schedule()

    def _init_schedule(self) -> None:
        """Hook: a schedule's own state, made once the shared state above is."""

    @property
    def started_at(self) -> float:
        """``time.perf_counter()`` when this policy was made: its records' ``elapsed_s`` count from it."""
        return self._t_start

    # -- prompts and groups -------------------------------------------------

    def next_group(self, gid: int) -> GroupRequest:
        """The group after ``gid`` others of this schedule (a resumed run's ids go on
        from the checkpoint's: a sample uid is never reused, in the queue or its dead groups)."""
        prompt = self.task.sample_prompts(self.rng, 1)[0]
        self.num_groups += 1
        return GroupRequest(group_id=f"g{self._group_base + gid}", prompt_ids=list(prompt.prompt_ids),
                            n=self.cfg.rollout.n, meta=dict(prompt.meta))

    def batch_request(self) -> BatchRequest:
        p = self.cfg.policy
        every, step = self.cfg.run.log_samples_every, self.step + 1
        show = every and (step == 1 or step % every == 0)  # run.log_samples of this step's samples, for samples.jsonl
        return BatchRequest(consumer=self.consumer, batch_size=self.cfg.batch_size * p.require_batches,
                            group_size=self.cfg.rollout.n, current_version=self.step,
                            max_staleness=p.max_staleness, num_examples=self.cfg.run.log_samples if show else 0)

    async def _train_once(self) -> StepReport:
        """One trainer step: the trainer takes its batch from the queue itself.
        A trainer that dies meanwhile cannot hand its batch back: its lease is
        expired here, so the samples are ready again (for a resumed run)."""
        step = asyncio.ensure_future(self.trainer.train_step(self.batch_request()))
        try:
            # a sample lost on its way leaves the step waiting for its group for good: say so instead
            while not (await asyncio.wait([step], timeout=FLOW_CHECK_S))[0]:
                await self.check_flow()
            return step.result()
        except AccountingError:
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
            raise
        except BaseException as err:
            if not step.done():  # cancelled here (the run's watchdog): the step goes too
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            if not isinstance(err, Exception) or not await is_dead(self.trainer):
                raise
            returned = await self.queue.expire_leases(force=True)
            raise ActorLostError(f"the trainer died during step {self.step + 1} ({one_line(err)}); the "
                                 f"{returned} samples it had leased are back in the queue; continue from the "
                                 "run's last checkpoint") from err

    async def _on_drop_after_queue(self, n: int) -> None:
        """Hook: samples the queue dropped (stale) after they were admitted."""

    @property
    def in_flight(self) -> int:
        """Samples being generated now (admitted, their group not reported yet)."""
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        # Rollout is busy while anything is in flight: integrate that time.
        now = time.perf_counter()
        if self._in_flight > 0:
            self._t_rollout_busy_s += now - self._t_busy_since
        self.admitted += max(0, value - self._in_flight)
        self._in_flight, self._t_busy_since = value, now

    def rollout_busy_s(self) -> float:
        busy = self._t_rollout_busy_s
        if self._in_flight > 0:
            busy += time.perf_counter() - self._t_busy_since
        return busy

    async def outstanding(self) -> int:
        """Samples admitted and not yet trained or dropped (a group being put
        counts twice until its report comes back: admission errs on the safe side)."""
        return self.in_flight + await self.pending()

    async def pending(self) -> int:
        """Samples in the queue: waiting, or handed out and not yet acknowledged."""
        stats = await self.queue.statistics_async()
        return stats.pending + stats.in_flight

    # -- the trainer side ---------------------------------------------------

    async def _before_step(self) -> None:
        """Called before every trainer step (the baselines generate here)."""

    @abc.abstractmethod
    async def _after_step(self) -> None:
        """Called after every trainer step (weight sync decisions live here)."""

    async def _start_background(self) -> None:
        """Start whatever runs beside the trainer loop (nothing by default)."""

    def rollout_idle(self) -> bool:
        """Whether rollout has stopped by itself between train calls: what the
        schedule generates ahead of the trainer is generated and reported (the
        fully-async feeder stops at a full admission window)."""
        return self.in_flight == 0

    def background_tasks(self) -> list[asyncio.Task[None]]:
        """The tasks of this schedule that live on between train calls (parked
        once :meth:`rollout_idle`); any other task left then is a leak."""
        evaluating = [self._eval[1]] if self._eval is not None and self.evaluating() else []
        return [*self._respawning, *evaluating]  # replacements being set up, an evaluation running

    async def sync_weights(self, released: asyncio.Event | None = None) -> None:
        """Push this step's weights to the engines (and to replacements waiting to
        join); its metrics go into this step's record (filled in later if the sync
        outlives the step). A push that fails is absorbed when it can be (see
        :meth:`_failed_push`)."""
        await self._eval_finished()  # an evaluation pins the engines' weights: the push comes after it
        step, t0 = self.step, time.perf_counter()
        result = await self._push(released)
        result["sync_s"] = time.perf_counter() - t0
        if self._record is not None and self._record[0] == step:
            self._record[1].update({f"sync/{k}": v for k, v in result.items()})
        else:
            self.last_sync = result

    async def _push(self, released: asyncio.Event | None = None) -> dict[str, object]:
        """One push to every rollout actor and every replacement ready to join; the
        joiners are rollout actors once it succeeds. Returns its metrics."""
        if not self.rollouts and not self._joining and self._respawning:
            await asyncio.wait(set(self._respawning))  # nothing to push to before a replacement is up
        if not self.rollouts and not self._joining:
            raise self.no_rollouts_left()
        joining, self._joining = self._joining, []
        engines = [*self.rollouts, *joining]
        if joining:
            self._weight_link_stale = True  # a broadcast group has no place for them yet
        try:
            await self._reform_weight_link(engines)
            extra = {} if released is None else {"released": released}
            result: dict[str, object] = dict(await self.weight_sync(engines, self.trainer, **extra))
            self._failed_pushes_in_a_row = 0
        except Exception as err:
            result = await self._failed_push(err, engines, joining)
        else:
            if joining:
                self.rollouts = [*self.rollouts, *joining]
                result["joined"] = len(joining)
                log.warning("rollout actor(s) %s joined at version %s", ", ".join(h.name for h in joining),
                            result.get("version"))
                self._notify_rollouts()
        return result

    async def settle(self, step: int | None = None) -> None:
        """Wait for work that outlives a step (a weight push still running, an
        evaluation), only that of steps up to ``step`` if given: call it before this
        loop stops, so no engine stays paused meanwhile, and before reading a
        step's record as final."""
        await self._push_finished(step)
        await self._eval_finished(step)

    def settled(self, step: int) -> bool:
        """Whether :meth:`settle` of ``step`` would return at once (its record is final)."""
        return not (self.evaluating() and self._eval[0] <= step) and self._push_settled(step)  # type: ignore[index]

    async def _push_finished(self, step: int | None = None) -> None:
        """Wait for a weight push of a step up to ``step`` still running (none by default)."""

    def _push_settled(self, step: int) -> bool:
        return True

    async def train(self, num_steps: int) -> list[dict[str, object]]:
        """Run ``num_steps`` trainer steps; returns one metrics dict per step."""
        await self._start_background()
        if self._weight_link is None and self.respawn_rollout is not None and self.rollouts:
            # how weights reach the rollout actors, for a broadcast group re-formed when all of them died
            self._weight_link = await self.rollouts[0].weight_link()
        out = []
        for _ in range(num_steps):
            t0 = time.perf_counter()
            await self._before_step()
            report = await self._train_once()
            self.examples = report.examples
            self.trained += report.num_samples
            self.step += 1
            dropped = sum(report.dropped.values())
            if dropped:
                await self._on_drop_after_queue(dropped)
            t2 = time.perf_counter()
            await self._after_step()
            t3 = time.perf_counter()
            self._t_trainer_busy_s += report.train_s
            pending = await self.check_accounting()
            record = self._step_metrics(report, pending, wait_s=t2 - t0 - report.train_s, after_s=t3 - t2)
            self.last_sync, self._record = {}, (self.step, record)
            every = self.cfg.policy.eval_every
            if every and self.step % every == 0:
                await self.evaluate_beside(record)
            out.append(record)
        return out

    # -- evaluations ----------------------------------------------------------

    async def evaluate_beside(self, record: dict[str, object]) -> None:
        """Evaluate this step's weights beside the steps that follow; the result goes
        into ``record`` (final once :meth:`settled`). The engines keep these weights
        until it ends: every push waits for it (:meth:`sync_weights`); fully-async
        trains on meanwhile (``policy.eval_overlap_steps``). One at a time."""
        await self._eval_finished()
        self._eval = (self.step, asyncio.create_task(self._eval_into(record, self.trained), name=f"eval-{self.step}"))

    async def _eval_into(self, record: dict[str, object], at_trained: int) -> None:
        await self._push_finished()  # the weights of this step reach the engines first
        record.update(await self._evaluate(at_trained))

    def evaluating(self) -> bool:
        """Whether an evaluation of an earlier step is still running."""
        return self._eval is not None and not self._eval[1].done()

    async def _eval_finished(self, step: int | None = None) -> None:
        """Wait for the evaluation of a step up to ``step`` (any, by default); its error is raised here."""
        if self._eval is None or (step is not None and self._eval[0] > step):
            return
        task = self._eval[1]
        await asyncio.wait([task])  # a waiter cancelled here leaves the evaluation running
        if self._eval is not None and self._eval[1] is task:  # the first waiter takes its result (or error)
            self._eval = None
            task.result()

    async def evaluate(self) -> dict[str, float]:
        """Greedy responses to the task's fixed held-out prompts on the weights of
        this step (a push or an evaluation still running is finished first), spread
        over the rollout actors: ``eval/reward`` is their mean reward."""
        await self.settle()
        return await self._evaluate(self.trained)

    async def _evaluate(self, at_trained: int) -> dict[str, float]:
        t0 = time.perf_counter()
        prompts = self.task.eval_prompts(self.cfg.policy.eval_prompts)
        requests = [GroupRequest(group_id=f"eval{i}", prompt_ids=list(p.prompt_ids), n=1, meta=dict(p.meta))
                    for i, p in enumerate(prompts)]
        k = len(self.rollouts)
        parts = await asyncio.gather(*(h.evaluate(requests[i::k]) for i, h in enumerate(self.rollouts)))
        scored = [r for part in parts for r in part]
        rewards = [reward for reward, _ in scored if reward is not None]
        return {"eval/reward": sum(rewards) / len(rewards) if rewards else 0.0,
                "eval/num_prompts": len(scored), "eval/num_errors": len(scored) - len(rewards),
                "eval/response_len_mean": sum(n for _, n in scored) / max(1, len(scored)),
                "eval/at_trained": at_trained, "eval/s": time.perf_counter() - t0}

    def _step_metrics(self, report: StepReport, pending: int, *, wait_s: float, after_s: float) -> dict[str, object]:
        elapsed = time.perf_counter() - self._t_start
        step_s = wait_s + report.train_s + after_s
        return {
            "step": self.step,
            "version": self.step,
            **{k: v for k, v in report.metrics.items()},
            "samples_per_s": self.trained / elapsed,
            "tokens_per_s_step": report.num_tokens / step_s if step_s > 0 else 0.0,
            "num_tokens": report.num_tokens,
            "trainer_idle_ratio": 1.0 - self._t_trainer_busy_s / elapsed,
            "rollout_idle_ratio": max(0.0, 1.0 - self.rollout_busy_s() / elapsed),
            "wait_s": wait_s,
            "train_s": report.train_s,
            "produced": self.produced,
            "trained": self.trained,
            "pending": pending,
            "dropped": dict(self.dropped),
            "elapsed_s": elapsed,
            **({"failed_pushes": self.num_failed_pushes} if self.num_failed_pushes else {}),
            **({"lost_rollout_actors": self.num_lost_rollouts} if self.num_lost_rollouts else {}),
            **({"respawned_rollout_actors": self.num_respawns} if self.num_respawns else {}),
            **{f"sync/{k}": v for k, v in self.last_sync.items()},
        }

    async def close(self) -> None:
        """Stop background work; the queue and actors belong to the caller."""
        tasks = [*self._respawning, *([self._eval[1]] if self._eval is not None else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
