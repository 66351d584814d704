"""The accounting of a schedule: what it counts of every sample, the identities
those counts must satisfy, and what a checkpoint keeps of them. A mixin of
:class:`policies.base.PolicyBase`, which feeds it (``on_group`` for every group
report, ``in_flight`` as groups go out and come back, ``trained`` every step).

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
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

from contracts.rollout import GroupReport, RolloutCounts
from policies.reward_guard import RewardGuard

__all__ = ["Accounting", "AccountingError"]


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


class Accounting:
    """Sample counters of a schedule and the checks on them (module docstring)."""

    # what it reads of the schedule (PolicyBase and the RolloutFaults mixin own these)
    cfg: Any
    rollouts: list[Any]
    queue: Any
    consumer: str
    rng: random.Random
    step: int
    trained: int
    admitted: int
    in_flight: int
    reward_guard: RewardGuard
    num_groups: int
    _group_base: int
    _in_flight: int
    _t_start: float
    _t_trainer_busy_s: float
    _t_rollout_busy_s: float
    _t_busy_since: float
    num_failed_pushes: int
    num_lost_rollouts: int
    num_respawns: int

    def _init_accounting(self) -> None:
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

    def rollout_busy_s(self) -> float:
        """Seconds rollout was busy (anything in flight), PolicyBase's clock."""
        raise NotImplementedError

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
