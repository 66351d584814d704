"""What every schedule shares: prompt groups, accounting, trainer steps, weight syncs, metrics.

The policy drives the actors with control messages only: a group request to
a rollout actor (which queues the finished samples itself and reports
counts), a batch request to the trainer (which takes its batch from the
TransferQueue, trains, acks and reports counts), sync triggers. Sample and
weight payloads never pass through it.

Accounting invariant, checked after every step from the queue's counters and
the actors' reports (and: the trainer's reported samples are the queue's
acknowledged ones; the queue holds no sample a rollout actor did not report,
beyond the groups still in flight):

    produced == trained + dropped + pending

``produced``: samples that came back from rollout (queued, or dropped by the
rollout actor: a failed reward, an aborted generation, an incomplete group);
``trained``: samples the trainer reported trained and acknowledged (checked
against the queue's own count of acknowledged samples); ``dropped``: by reason,
in the rollout actors and in the queue (too stale); ``pending``: in the queue,
waiting or leased and not yet acknowledged.

That identity takes ``produced`` from the queue, so alone it cannot see a sample
lost between a rollout actor and the queue. Each rollout actor also counts for
itself (``RolloutCounts``, carried by every report: the policy keeps each
actor's latest, a dead actor's as last seen), and the same check asserts

    generated == queued + dropped before the queue          per actor
    actors' queued <= queue's put <= actors' queued + lost + in flight

(``lost``: samples of groups a dead actor took unreported that the queue had).
With no group in flight the second is an equality: the live actors' own
``queued``, the dead ones' reports, and the lost groups add up to ``put``.
``run.check()`` also reads the live actors' counters (``statistics``): with
rollout stopped they equal what their last reports carried. A checkpoint keeps
the actors' totals, the queue's ``put`` as their ``queued`` (the resumed run's
actors start from zero).

Faults (each keeps that identity):

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
from collections import Counter
from typing import Any

from contracts.rollout import GroupReport, GroupRequest, RolloutCounts
from contracts.training import BatchRequest, StepReport
from policies.faults import ACTOR_DIED, MAX_FAILED_PUSHES, ActorLostError, RolloutFaults, is_dead, one_line
from policies.reward_guard import RewardGuard

__all__ = ["ACTOR_DIED", "MAX_FAILED_PUSHES", "PolicyBase", "AccountingError", "ActorLostError", "NoProgressError",
           "is_dead"]

log = logging.getLogger(__name__)



def _rng_state(rng: random.Random) -> list[Any]:
    """``rng``'s state as JSON values."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from_state(state: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return version, tuple(internal), gauss


class AccountingError(AssertionError):
    """produced != trained + dropped + pending, or a rollout actor's own counts do
    not add up (or not to the queue's): a sample was lost or counted twice."""


class NoProgressError(RuntimeError):
    """No trainer step finished within the watchdog's time (``run.watchdog_s``);
    the message says what each part of the run was waiting on."""


class PolicyBase(RolloutFaults, abc.ABC):
    """Shared machinery; subclasses decide *when* rollout, training and sync happen."""

    consumer = "trainer"

    def __init__(self, cfg: Any, *, rollouts: list[Any], trainer: Any, queue: Any, task: Any,
                 weight_sync: Any, respawn_rollout: Any = None) -> None:
        self.cfg, self.rollouts, self.trainer, self.queue, self.task = cfg, rollouts, trainer, queue, task
        # coroutine fn: (rollouts, trainer, released=None) -> dict of sync metrics; sets ``released``
        # (an asyncio.Event) once the trainer may step again (see sync.link.push_weights)
        self.weight_sync = weight_sync
        self.rng = random.Random(cfg.run.seed)
        self.step = 0  # trainer steps done == trainer weight version
        self.trained = 0
        self.rollout_queued = 0  # samples the rollout actors reported queued
        self.rollout_dropped: Counter[str] = Counter()  # dropped by the rollout actors, by reason
        self.queue_dropped: Counter[str] = Counter()  # dropped by the queue, by reason (last statistics)
        self.queue_put = 0  # samples the queue registered (last statistics)
        # each rollout actor's own counts (see the module docstring): the latest totals its reports
        # carried, by name (a dead actor's stay), and the samples its reports said queued
        self.rollout_counts: dict[str, RolloutCounts] = {}
        self._reported_queued: Counter[str] = Counter()
        self.lost_queued = 0  # samples of groups a dead actor took unreported, found in the queue
        self.rollout_counts_base = RolloutCounts()  # the actors before the checkpoint this run resumed from
        self._in_flight = 0
        self.admitted = 0  # samples ever sent to rollout (in flight, reported or not)
        self._t_rollout_busy_s = 0.0
        self._t_busy_since = 0.0
        self._t_start = time.perf_counter()
        self._t_trainer_busy_s = 0.0
        self.last_sync: dict[str, Any] = {}  # a finished sync whose step has no record yet
        self._record: tuple[int, dict[str, Any]] | None = None  # (step, metrics) of the latest step
        self._init_faults(respawn_rollout)
        reward = cfg.task.kwargs.get("reward")
        self.reward_guard = RewardGuard(
            name=repr(reward) if reward else f"of task {cfg.task.type!r}", max_share=cfg.policy.max_reward_error_share,
            window=cfg.policy.reward_error_window, min_samples=2 * cfg.rollout.n)
        self.num_groups = 0  # prompt groups named by this run (ids g0, g1, ...)
        self._group_base = 0  # ... and before the checkpoint it resumed from (its ids go on after those)

    # -- prompts and groups -------------------------------------------------

    def next_group(self, gid: int) -> GroupRequest:
        """The group after ``gid`` others of this schedule (a resumed run's ids go on
        from the checkpoint's: a sample uid is never reused, in the queue or its dead groups)."""
        prompt = self.task.sample_prompts(self.rng, 1)[0]
        self.num_groups += 1
        return GroupRequest(group_id=f"g{self._group_base + gid}", prompt_ids=list(prompt.prompt_ids),
                            n=self.cfg.rollout.n, meta=dict(prompt.meta))

    def on_group(self, report: GroupReport, actor: str) -> int:
        """Count rollout actor ``actor``'s report on a group (or the policy's own, for a
        group the actor died with: :meth:`lost_group`); returns the samples it queued."""
        self.rollout_queued += report.num_queued
        self.rollout_dropped.update(report.dropped)
        if report.counts is None:
            self.lost_queued += report.num_queued
        else:
            seen = self.rollout_counts.get(actor)
            if seen is None or report.counts.generated > seen.generated:  # one report may overtake another
                self.rollout_counts[actor] = report.counts
            self._reported_queued[actor] += report.num_queued
        self.reward_guard.observe(report)  # counted above first: a run it stops still adds up
        return report.num_queued

    def rollout_totals(self) -> RolloutCounts:
        """The rollout actors' own counts summed: this run's (dead ones as last seen)
        and those before the checkpoint it resumed from."""
        counts = [self.rollout_counts_base, *self.rollout_counts.values()]
        dropped: Counter[str] = Counter()
        for c in counts:
            dropped.update(c.dropped)
        return RolloutCounts(generated=sum(c.generated for c in counts), queued=sum(c.queued for c in counts),
                             dropped=dict(dropped))

    @property
    def dropped(self) -> Counter[str]:
        return self.rollout_dropped + self.queue_dropped

    @property
    def produced(self) -> int:
        return self.queue_put + sum(self.rollout_dropped.values())

    def batch_request(self) -> BatchRequest:
        p = self.cfg.policy
        return BatchRequest(consumer=self.consumer, batch_size=self.cfg.batch_size * p.require_batches,
                            group_size=self.cfg.rollout.n, current_version=self.step,
                            max_staleness=p.max_staleness)

    async def _train_once(self) -> StepReport:
        """One trainer step: the trainer takes its batch from the queue itself.
        A trainer that dies meanwhile cannot hand its batch back: its lease is
        expired here, so the samples are ready again (for a resumed run)."""
        try:
            return await self.trainer.train_step(self.batch_request())
        except Exception as err:
            if not await is_dead(self.trainer):
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

    async def check_accounting(self) -> int:
        """Read the queue's counters and raise :class:`AccountingError` unless
        produced == trained + dropped + pending and the rollout actors' own counts
        add up, each and against the queue (module docstring); returns pending."""
        # Reports keep arriving while the queue answers: bound what it may hold by the
        # counters before the read (queued) and after it (admitted).
        queued_before, dropped_before = self.rollout_queued, sum(self.rollout_dropped.values())
        in_flight_before, admitted_before = self.in_flight, self.admitted
        actors_queued = self.rollout_totals().queued  # the queue registered all of it before this read
        stats = await self.queue.statistics_async()
        self.queue_put = stats.put
        self.queue_dropped = Counter(stats.dropped_by_reason)
        pending = stats.pending + stats.in_flight
        delivered = stats.consumers[self.consumer].delivered if self.consumer in stats.consumers else 0
        total_dropped = sum(self.dropped.values())
        # the queue holds every group reported queued, and may hold some whose report is
        # on its way, never more than were admitted and not reported dropped
        if (self.produced != self.trained + total_dropped + pending or delivered != self.trained
                or not queued_before <= stats.put <= self.admitted - dropped_before):
            raise AccountingError(f"produced={self.produced} != trained={self.trained} + "
                                  f"dropped={total_dropped} + pending={pending} (queue: put={stats.put}, "
                                  f"acknowledged={delivered}; rollout actors reported {self.rollout_queued} "
                                  f"queued, {self.admitted} admitted)")
        # nothing admitted and none in flight while the queue answered: every group is reported (or lost)
        self._check_rollout_counts(stats.put, actors_queued,
                                   exact=in_flight_before == 0 and self.admitted == admitted_before)
        return pending

    def _check_rollout_counts(self, put: int, actors_queued: int, *, exact: bool) -> None:
        """Each rollout actor's own identity, and the actors' ``queued`` against the queue's
        ``put`` (``actors_queued``: their totals read before ``put``). ``exact``: no group was
        in flight, so ``put`` is the live actors' own ``queued`` plus what the dead ones'
        reports said (their last totals may count a group whose report went down with them:
        it is among the lost ones) plus the lost ones."""
        for who, c in [("the rollout actors before the resume", self.rollout_counts_base),
                       *((f"rollout actor {name}", c) for name, c in self.rollout_counts.items())]:
            dropped = sum(c.dropped.values())
            if c.generated != c.queued + dropped:
                raise AccountingError(f"{who}: generated={c.generated} != queued={c.queued} + "
                                      f"dropped before the queue={dropped}")
        if actors_queued > put:  # an actor counts a group queued once its put returned
            raise AccountingError(f"rollout actors' queued={actors_queued} > queue put={put}: they counted samples "
                                  "the queue never registered")
        lost = self.lost_queued
        if exact:
            live = {h.name for h in self.rollouts}
            queued = self.rollout_counts_base.queued + sum(
                c.queued if name in live else self._reported_queued[name] for name, c in self.rollout_counts.items())
            if put != queued + lost:
                raise AccountingError(f"queue put={put} != rollout actors' queued={queued} + lost with a dead "
                                      f"actor={lost}, with no group in flight")
        elif put > (now := self.rollout_totals().queued) + lost + self.in_flight:  # in flight: maybe put, not counted
            raise AccountingError(f"queue put={put} > rollout actors' queued={now} + lost with a dead actor={lost} "
                                  f"+ in flight={self.in_flight}")

    def check_rollout_statistics(self, rollouts: list[Any], stats: list[dict[str, Any]]) -> None:
        """With rollout stopped (every group reported): each actor's counters as its
        ``statistics`` read them now are the totals its last report carried."""
        for h, st in zip(rollouts, stats):
            own = RolloutCounts(generated=st["num_generated"], queued=st["num_queued"], dropped=st["dropped"])
            seen = self.rollout_counts.get(h.name, RolloutCounts())
            if own != seen:
                raise AccountingError(f"rollout actor {h.name}: its counters (generated={own.generated}, queued="
                                      f"{own.queued}, dropped={own.dropped}) are not its last report's (generated="
                                      f"{seen.generated}, queued={seen.queued}, dropped={seen.dropped})")

    # -- checkpoints ----------------------------------------------------------

    IN_FLIGHT_AT_CHECKPOINT = "in_flight_at_checkpoint"
    """Drop reason of the samples a checkpoint finds being generated: a run
    resumed from it does not have them (their partial tokens are not saved)."""

    def state_dict(self, queue: Any) -> dict[str, Any]:
        """Counters, prompt RNG and admission state for a run checkpoint taken
        between trainer steps, consistent with ``queue`` (the counters of the
        TransferQueue snapshot saved with it, read just before this call).

        A resumed run has no generation in flight: samples admitted that are
        neither in that snapshot (``queue.put``) nor reported dropped are counted
        dropped, ``in_flight_at_checkpoint``, so ``produced == trained + dropped
        + pending`` holds across the resume. Their admission slots go back."""
        delivered = queue.consumers[self.consumer].delivered if self.consumer in queue.consumers else 0
        if delivered != self.trained:
            raise RuntimeError(f"checkpoint during a trainer step: the queue has {delivered} samples acknowledged, "
                               f"the policy {self.trained} trained; checkpoint between steps")
        rollout_dropped = Counter(self.rollout_dropped)
        lost = self.admitted - sum(rollout_dropped.values()) - queue.put
        assert lost >= 0, f"the queue registered {queue.put} samples of {self.admitted} admitted"
        if lost:
            rollout_dropped[self.IN_FLIGHT_AT_CHECKPOINT] += lost
        totals = self.rollout_totals()
        state: dict[str, Any] = {
            "step": self.step, "trained": self.trained, "admitted": self.admitted,
            "rollout_queued": min(self.rollout_queued, queue.put), "rollout_dropped": dict(rollout_dropped),
            "queue_put": queue.put, "queue_dropped": dict(queue.dropped_by_reason),
            "num_groups": self._group_base + self.num_groups, "rng": _rng_state(self.rng),
            "elapsed_s": time.perf_counter() - self._t_start, "trainer_busy_s": self._t_trainer_busy_s,
            "rollout_busy_s": self.rollout_busy_s(), "num_in_flight_dropped": lost,
            "num_failed_pushes": self.num_failed_pushes, "num_lost_rollouts": self.num_lost_rollouts,
            "num_respawns": self.num_respawns,
            # the actors before this checkpoint, as one: they queued what the queue registered (some of it
            # not in their counts yet: a put returning); a group in flight never finished generating
            "rollout_counts": {"generated": queue.put + sum(totals.dropped.values()), "queued": queue.put,
                               "dropped": totals.dropped},
        }
        admission = getattr(self, "admission", None)
        if admission is not None:
            # slots still held by samples a resumed run will not have (not yet reported, not in the queue)
            held = admission.num_admitted - sum(rollout_dropped.values()) - queue.put + lost
            state["admission"] = admission.state_dict(release=max(0, held))
        if hasattr(self, "_released_queue_drops"):
            # the fully-async schedule's mark of the queue's stale drops whose slots went back:
            # the restored queue keeps counting from its saved totals, none is released twice
            state["released_queue_drops"] = self._released_queue_drops
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state (before the first step of the resumed run)."""
        self.step, self.trained, self.admitted = state["step"], state["trained"], state["admitted"]
        self._in_flight = 0
        self.rollout_queued = state["rollout_queued"]
        self.rollout_dropped = Counter(state["rollout_dropped"])
        self.queue_put, self.queue_dropped = state["queue_put"], Counter(state["queue_dropped"])
        # new actors count from zero (the same names may come back): the old ones' totals are the base
        self.rollout_counts, self._reported_queued, self.lost_queued = {}, Counter(), 0
        self.rollout_counts_base = RolloutCounts(**state.get(
            "rollout_counts", {"generated": state["queue_put"], "queued": state["queue_put"]}))  # older checkpoints
        self._group_base, self.num_groups = state["num_groups"], 0
        self.rng.setstate(_rng_from_state(state["rng"]))
        now = time.perf_counter()
        self._t_start = now - state["elapsed_s"]
        self._t_trainer_busy_s, self._t_rollout_busy_s = state["trainer_busy_s"], state["rollout_busy_s"]
        self._t_busy_since = now
        # counters of the run before the checkpoint (its actors are new: none is lost or joining now)
        self.num_failed_pushes = state.get("num_failed_pushes", 0)
        self.num_lost_rollouts = state.get("num_lost_rollouts", 0)
        self.num_respawns = state.get("num_respawns", 0)
        admission = getattr(self, "admission", None)
        if admission is not None and "admission" in state:
            admission.load_state_dict(state["admission"])
        if hasattr(self, "_released_queue_drops") and "released_queue_drops" in state:
            self._released_queue_drops = state["released_queue_drops"]

    # -- the watchdog's report ---------------------------------------------

    async def waiting_on(self) -> str:
        """What each part of the run waits on now, in one line: the watchdog's
        report of a run whose trainer step does not finish."""
        p, n = self.cfg.policy, self.cfg.rollout.n
        need = self.cfg.batch_size * p.require_batches
        try:
            stats = await asyncio.wait_for(self.queue.statistics_async(), 10)
            queue = (f"queue: {stats.pending} samples waiting, {stats.in_flight} leased, {stats.put} put, dropped "
                     f"{dict(stats.dropped_by_reason) or 0}")
        except Exception as err:  # the report must not fail on what it reports
            queue = f"queue: no statistics ({type(err).__name__}: {err})"
        return "; ".join([
            f"trainer: step {self.step + 1} waits for {need} samples in whole groups of {n}, none older than "
            f"version {self.step - p.max_staleness} (trainer version {self.step}, policy.max_staleness={p.max_staleness})",
            queue,
            f"rollout actors: {self.in_flight} samples being generated{self._rollout_detail()}, dropped by them "
            f"{dict(self.rollout_dropped) or 0}"
            + (f" (the last reward error: {self.reward_guard.last_error})" if self.reward_guard.last_error else ""),
            *self._waiting_detail(),
        ])

    def _rollout_detail(self) -> str:
        return ""

    def _waiting_detail(self) -> list[str]:
        """Subclasses: what else waits (admission, a weight push), a phrase each."""
        return []

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

    def background_tasks(self) -> list[asyncio.Task[Any]]:
        """The tasks of this schedule that live on between train calls (parked
        once :meth:`rollout_idle`); any other task left then is a leak."""
        return list(self._respawning)  # replacements being set up

    async def sync_weights(self, released: asyncio.Event | None = None) -> None:
        """Push this step's weights to the engines (and to replacements waiting to
        join); its metrics go into this step's record (filled in later if the sync
        outlives the step). A push that fails is absorbed when it can be (see
        :meth:`_failed_push`)."""
        step, t0 = self.step, time.perf_counter()
        extra = {} if released is None else {"released": released}
        result = await self._push(**extra)
        result["sync_s"] = time.perf_counter() - t0
        if self._record is not None and self._record[0] == step:
            self._record[1].update({f"sync/{k}": v for k, v in result.items()})
        else:
            self.last_sync = result

    async def _push(self, **kwargs: Any) -> dict[str, Any]:
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
            result = dict(await self.weight_sync(engines, self.trainer, **kwargs))
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
        """Wait for work that outlives a step (a weight push still running),
        only that of steps up to ``step`` if given: call it before this loop
        stops, so no engine stays paused meanwhile, and before reading a
        step's record as final."""

    async def train(self, num_steps: int) -> list[dict[str, Any]]:
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
                record.update(await self.evaluate())
            out.append(record)
        return out

    async def evaluate(self) -> dict[str, float]:
        """Greedy responses to the task's fixed held-out prompts on the weights of
        this step (a push still running is finished first), spread over the
        rollout actors: ``eval/reward`` is their mean reward."""
        await self.settle()
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
                "eval/at_trained": self.trained, "eval/s": time.perf_counter() - t0}

    def _step_metrics(self, report: StepReport, pending: int, *, wait_s: float, after_s: float) -> dict[str, Any]:
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
        tasks = list(self._respawning)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
