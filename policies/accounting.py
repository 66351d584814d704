"""The accounting of a schedule: what it counts of every sample, the identities
those counts must satisfy, and what a checkpoint keeps of them. A mixin of
:class:`policies.base.PolicyBase`, which feeds it (``group_sent`` as a group
goes out, ``on_group`` for every report, ``trained`` every step).

A sample's way, and who counts it at each point (each count kept by another
component, so a sample lost between two points shows as a difference):

    the policy       admitted (a group sent out: its size, its actor, named in
                     ``groups_out`` until its report comes back); reported
    a rollout actor  received (as the request arrives), generated (the group
                     done), of those queued or dropped by reason; working (in between)
    the queue        put, dropped by reason (too stale), pending, acknowledged
    the trainer      trained (the samples of its steps)

Checked on every report (at once: the samples a report misses are nowhere else):
it is on a group out, counts the samples asked for, and ``queued + dropped ==
samples``. Checked after every step, in that order, each naming its term:

    admitted == reported + out                   the policy's ledger
    received == generated + working               per rollout actor, as last reported
    generated == queued + dropped before the queue  per rollout actor
    actors' queued <= queue put <= reported queued + out
    trained == the queue's acknowledged
    produced == trained + dropped + pending       the queue's side

``out``: the samples of the groups sent out and not reported (named, of known
sizes, bounded by admission): the only tolerance. ``produced``: the queue's
``put`` plus the rollout actors' drops; ``dropped``: theirs and the queue's;
``pending``: in the queue, waiting or leased. An actor counts a group queued
once its put returned, so its ``queued`` never runs ahead of ``put`` (dead
actors as last seen; ``lost_queued``: samples of a group a dead actor took
unreported that the queue had). ``run.check()`` also reads the live actors'
counters (``statistics``): with rollout stopped they equal what their last
reports carried. A checkpoint files as ``in_flight_at_checkpoint`` the samples
admitted that are neither in the queue's snapshot nor reported dropped, once the
snapshot is shown to hold what was reported queued before it plus at most the
groups out then; any other shortfall raises. It keeps the actors' totals, the queue's ``put`` as their ``queued``
(the resumed run's actors start from zero).
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from typing import Any

from contracts.handles import RolloutHandle
from contracts.rollout import GroupReport, GroupRequest, RolloutCounts
from policies.config import RunSettings
from policies.reward_guard import RewardGuard
from transfer_queue import QueueStats, TransferQueue

__all__ = ["Accounting", "AccountingError"]


def _rng_state(rng: random.Random) -> list[object]:
    """``rng``'s state as JSON values."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from_state(state: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return version, tuple(internal), gauss


def _counts(c: RolloutCounts) -> str:
    return (f"received={c.received}, working={c.working}, generated={c.generated}, queued={c.queued}, "
            f"dropped={c.dropped}")


class AccountingError(AssertionError):
    """produced != trained + dropped + pending, or a rollout actor's own counts do
    not add up (or not to the queue's): a sample was lost or counted twice."""


class Accounting:
    """Sample counters of a schedule and the checks on them (module docstring)."""

    # what it reads of the schedule (PolicyBase and the RolloutFaults mixin own these)
    cfg: RunSettings
    rollouts: list[RolloutHandle]
    queue: TransferQueue
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
        # the groups sent out and not reported yet: id -> (samples asked for, rollout actor)
        self.groups_out: dict[str, tuple[int, str]] = {}
        self.reported = 0  # samples of the groups reported (each report's num_samples)
        self._checkpoint_mark: tuple[int, int, str] | None = None  # (reported queued, out, named) before a snapshot
        # each rollout actor's own counts (see the module docstring): the latest totals its reports
        # carried, by name (a dead actor's stay), and the samples its reports said queued
        self.rollout_counts: dict[str, RolloutCounts] = {}
        self.lost_queued = 0  # samples of groups a dead actor took unreported, found in the queue
        self.rollout_counts_base = RolloutCounts()  # the actors before the checkpoint this run resumed from

    def rollout_busy_s(self) -> float:
        """Seconds rollout was busy (anything in flight), PolicyBase's clock."""
        raise NotImplementedError

    def group_sent(self, group: GroupRequest, actor: str) -> None:
        """``group`` goes out to rollout actor ``actor``: in flight until its report."""
        self.groups_out[group.group_id] = (group.n, actor)
        self.in_flight += group.n

    def on_group(self, report: GroupReport, actor: str) -> int:
        """Count rollout actor ``actor``'s report on a group sent out (or the policy's own,
        for a group the actor died with: :meth:`lost_group`); returns the samples it
        queued. A report that does not add up, or not to the group asked for, raises
        :class:`AccountingError` at once (the samples it misses are nowhere else)."""
        out = self.groups_out.get(report.group_id)
        if out is None:
            raise AccountingError(f"rollout actor {actor} reported group {report.group_id}, which is not out: "
                                  "never sent, or reported twice")
        asked, to = out
        dropped = sum(report.dropped.values())
        if report.num_samples != asked:
            raise AccountingError(f"group {report.group_id}: the policy asked rollout actor {to} for {asked} samples, "
                                  f"its report counts {report.num_samples} (queued {report.num_queued} + dropped "
                                  f"{dropped}): {asked - report.num_samples} lost in the actor")
        if report.num_queued + dropped != report.num_samples:
            raise AccountingError(f"group {report.group_id} from rollout actor {actor}: queued {report.num_queued} + "
                                  f"dropped {dropped} != its {report.num_samples} samples")
        del self.groups_out[report.group_id]  # the report adds up: counted, no longer out
        self.in_flight -= asked
        self.reported += asked
        self.rollout_queued += report.num_queued
        self.rollout_dropped.update(report.dropped)
        if report.counts is None:
            self.lost_queued += report.num_queued
        else:
            seen = self.rollout_counts.get(actor)
            # the newest totals (one report may overtake another): both counts only grow, one with every report
            if seen is None or report.counts.received + report.counts.generated > seen.received + seen.generated:
                self.rollout_counts[actor] = report.counts
        self.reward_guard.observe(report)  # counted above first: a run it stops still adds up
        return report.num_queued

    def rollout_totals(self) -> RolloutCounts:
        """The rollout actors' own counts summed: this run's (dead ones as last seen)
        and those before the checkpoint it resumed from."""
        counts = [self.rollout_counts_base, *self.rollout_counts.values()]
        dropped: Counter[str] = Counter()
        for c in counts:
            dropped.update(c.dropped)
        return RolloutCounts(received=sum(c.received for c in counts), working=sum(c.working for c in counts),
                             generated=sum(c.generated for c in counts), queued=sum(c.queued for c in counts),
                             dropped=dict(dropped))

    @property
    def dropped(self) -> Counter[str]:
        return self.rollout_dropped + self.queue_dropped

    @property
    def produced(self) -> int:
        return self.queue_put + sum(self.rollout_dropped.values())

    def _out_samples(self) -> int:
        return sum(n for n, _ in self.groups_out.values())

    def _out_named(self) -> str:
        """The groups out, named (the first few) with their actors."""
        names = [f"{gid}@{actor}" for gid, (_, actor) in itertools.islice(self.groups_out.items(), 4)]
        more = len(self.groups_out) - len(names)
        return ", ".join(names) + (f" and {more} more" if more > 0 else "") if names else "none"

    async def check_accounting(self) -> int:
        """Read the queue's counters and raise :class:`AccountingError` naming the first
        term, along a sample's way, that does not balance (module docstring); returns
        pending (samples in the queue, waiting or leased)."""
        stats = await self.check_flow()
        pending = stats.pending + stats.in_flight
        delivered = stats.consumers[self.consumer].delivered if self.consumer in stats.consumers else 0
        if delivered != self.trained:
            raise AccountingError(f"the trainer reported {self.trained} samples trained, the queue has {delivered} "
                                  "acknowledged")
        total_dropped = sum(self.dropped.values())
        if self.produced != self.trained + total_dropped + pending:
            raise AccountingError(f"produced={self.produced} (queue put={stats.put} + dropped by rollout actors="
                                  f"{sum(self.rollout_dropped.values())}) != trained={self.trained} + dropped="
                                  f"{total_dropped} + pending={pending}: the queue lost or made up samples")
        return pending

    async def check_flow(self) -> QueueStats:
        """The terms that hold at any time, a trainer step running or not: the ledger, each
        rollout actor's identities, the queue's ``put`` between the actors' counts. Returns
        the queue's statistics, read once."""
        self._check_ledger()
        self._check_rollout_counts()
        actors_queued = self.rollout_totals().queued  # the queue registered all of it before this read
        reported_queued, out_before = self.rollout_queued, self._out_samples()
        stats = await self.queue.statistics_async()
        self.queue_put = stats.put
        self.queue_dropped = Counter(stats.dropped_by_reason)
        self._check_put(stats.put, actors_queued, reported_queued, out_before)
        return stats

    def _check_ledger(self) -> None:
        """Every sample admitted is in a report or in a group out (named, each of a known size)."""
        out = self._out_samples()
        if self.admitted != self.reported + out or self.in_flight != out:
            raise AccountingError(f"admitted={self.admitted} != reported={self.reported} + out={out} "
                                  f"(groups out: {self._out_named()}; in flight {self.in_flight})")

    def _check_rollout_counts(self) -> None:
        """Each rollout actor's own identities, as its latest report carried them."""
        for who, c in [("the rollout actors before the resume", self.rollout_counts_base),
                       *((f"rollout actor {name}", c) for name, c in self.rollout_counts.items())]:
            if c.received != c.generated + c.working:
                raise AccountingError(f"{who}: received={c.received} != generated={c.generated} + working="
                                      f"{c.working}: {c.received - c.generated - c.working} samples lost in the "
                                      "actor before any other count")
            dropped = sum(c.dropped.values())
            if c.generated != c.queued + dropped:
                raise AccountingError(f"{who}: generated={c.generated} != queued={c.queued} + "
                                      f"dropped before the queue={dropped}")

    def _check_put(self, put: int, actors_queued: int, reported_queued: int, out: int) -> None:
        """The queue's ``put`` between what the rollout actors counted queued before the
        read (each counts a group once its put returned) and what their reports said
        plus the groups out then (a group out may be in the queue, its report on its way)."""
        if put < actors_queued:
            raise AccountingError(f"the queue registered put={put}, {actors_queued - put} fewer than the "
                                  f"{actors_queued} samples the rollout actors counted queued: lost between the "
                                  "actors and the queue")
        if put > reported_queued + out:
            raise AccountingError(f"the queue registered put={put} > reported queued={reported_queued} + out={out} "
                                  f"(groups out: {self._out_named()}): the queue holds samples no group accounts for")

    def check_rollout_statistics(self, rollouts: list[RolloutHandle], stats: list[dict[str, Any]]) -> None:
        """With rollout stopped (every group reported): each actor's counters as its
        ``statistics`` read them now are the totals its last report carried."""
        for h, st in zip(rollouts, stats):
            own = RolloutCounts(received=st["num_received"], working=st["num_working"], generated=st["num_generated"],
                                queued=st["num_queued"], dropped=st["dropped"])
            seen = self.rollout_counts.get(h.name, RolloutCounts())
            if own != seen:
                raise AccountingError(f"rollout actor {h.name}: its counters ({_counts(own)}) are not its last "
                                      f"report's ({_counts(seen)})")

    # -- checkpoints ----------------------------------------------------------

    IN_FLIGHT_AT_CHECKPOINT = "in_flight_at_checkpoint"
    """Drop reason of the samples a checkpoint finds being generated: a run
    resumed from it does not have them (their partial tokens are not saved)."""

    def state_dict(self, queue: QueueStats) -> dict[str, object]:
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
        lost = self._lost_at_checkpoint(queue.put)
        if lost:
            rollout_dropped[self.IN_FLIGHT_AT_CHECKPOINT] += lost
        totals = self.rollout_totals()
        state: dict[str, object] = {
            "step": self.step, "trained": self.trained, "admitted": self.admitted,
            # the groups out that the queue has count as reported in the resumed run
            "rollout_queued": queue.put, "rollout_dropped": dict(rollout_dropped), "rollout_dropped": dict(rollout_dropped),
            "queue_put": queue.put, "queue_dropped": dict(queue.dropped_by_reason),
            "num_groups": self._group_base + self.num_groups, "rng": _rng_state(self.rng),
            "elapsed_s": time.perf_counter() - self._t_start, "trainer_busy_s": self._t_trainer_busy_s,
            "rollout_busy_s": self.rollout_busy_s(), "num_in_flight_dropped": lost,
            "num_failed_pushes": self.num_failed_pushes, "num_lost_rollouts": self.num_lost_rollouts,
            "num_respawns": self.num_respawns,
            # the actors before this checkpoint, as one: they queued what the queue registered (some of it
            # not in their counts yet: a put returning); a group in flight never finished generating
            "rollout_counts": {"received": (generated := queue.put + sum(totals.dropped.values())),
                               "generated": generated, "queued": queue.put, "dropped": totals.dropped},
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

    def mark_checkpoint(self) -> None:
        """Note the reports and the groups out just before the queue's snapshot is taken:
        reports keep coming while it is written, and :meth:`state_dict` checks the snapshot
        against what was reported before it."""
        self._checkpoint_mark = (self.rollout_queued, self._out_samples(), self._out_named())

    def _lost_at_checkpoint(self, put: int) -> int:
        """The samples a checkpoint finds being generated: admitted, neither in the queue's
        snapshot (``put``: its count there) nor reported dropped. The snapshot holds what was
        reported queued before it plus part of the groups out then (named, each of a known
        size, their reports on their way); any other difference raises
        :class:`AccountingError`: it is no sample in flight."""
        self._check_ledger()
        queued, out, named = self._checkpoint_mark or (
            self.rollout_queued, self._out_samples(), self._out_named())
        self._checkpoint_mark = None
        if not 0 <= put - queued <= out:
            raise AccountingError(f"checkpoint: the queue registered put={put}, the reports before it {queued} "
                                  f"queued; the difference {put - queued} is not within the {out} samples of the "
                                  f"groups out then ({named})")
        return self.admitted - sum(self.rollout_dropped.values()) - put

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state (before the first step of the resumed run)."""
        self.step, self.trained, self.admitted = state["step"], state["trained"], state["admitted"]
        self.reported, self.groups_out = self.admitted, {}  # a resumed run has no group out
        self._in_flight = 0
        self.rollout_queued = state["rollout_queued"]
        self.rollout_dropped = Counter(state["rollout_dropped"])
        self.queue_put, self.queue_dropped = state["queue_put"], Counter(state["queue_dropped"])
        # new actors count from zero (the same names may come back): the old ones' totals are the base
        self.rollout_counts, self.lost_queued = {}, 0
        base = state.get("rollout_counts", {"generated": state["queue_put"], "queued": state["queue_put"]})
        self.rollout_counts_base = RolloutCounts(**{"received": base["generated"], **base})  # older checkpoints
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
