"""Faults of the parts a schedule drives: rollout actors that die (and their
replacements), weight pushes that fail. A mixin of :class:`policies.base.PolicyBase`,
which owns the rest (``rollouts``, ``trainer``, ``_push``); the rules are in
that module's docstring.

    rollout actor dies ─► lose_rollout: out of ``rollouts``, counted; weight group stale;
         │               lost_group: each of its unreported groups dropped, ``actor_died``
         │ rollout.max_respawns left?
         ▼
    _replace (task): respawn_rollout(dead) ─► ``_joining`` ─► the next push sends it the
         trainer's weights (full: it is at no delta's base) and the re-formed group takes
         it in ─► ``rollouts``;  no actor left: join_replacements pushes at once
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from contracts.handles import RolloutHandle, TrainerHandle
from contracts.rollout import GroupReport, GroupRequest
from policies.config import RunSettings
from sync.errors import SyncFailed
from sync.link import WeightGroupLost, reform_weight_link
from sync.sequence import resume_engines
from transfer_queue import TransferQueue

__all__ = ["ACTOR_DIED", "MAX_FAILED_PUSHES", "ActorLostError", "Respawn", "RolloutFaults", "is_dead", "one_line"]

#: (a dead rollout actor's handle) -> a new rollout actor, set up, its weight link open (not its
#: broadcast group: that is re-formed with everyone before the push it joins at)
Respawn = Callable[[RolloutHandle], Awaitable[RolloutHandle]]

log = logging.getLogger(__name__)

ACTOR_DIED = "actor_died"  # drop reason of the samples a dead rollout actor took with it
MAX_FAILED_PUSHES = 3  # weight pushes in a row that may fail before the run stops
_PING_TIMEOUT_S = 10.0


class ActorLostError(RuntimeError):
    """A part the run cannot go on without died: the trainer, or the last
    rollout actor. The message (one line) says which, why, and what became of
    the samples it held."""


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (or its type's name)."""
    return " ".join(str(err).split()) or type(err).__name__


async def is_dead(handle: object) -> bool:
    """Whether the actor behind ``handle`` (any of a group's ``workers``) is gone:
    its ``ping`` raises (a process that ended, a Ray actor that died). One that
    does not answer in time may be busy, and a handle without ``ping`` cannot
    tell: neither is known dead."""
    workers = getattr(handle, "workers", None)
    if isinstance(workers, list):
        return any(await asyncio.gather(*(is_dead(w) for w in workers)))
    try:
        ping: Callable[[], Awaitable[int]] = getattr(handle, "ping")
    except AttributeError:
        return False
    try:
        await asyncio.wait_for(ping(), _PING_TIMEOUT_S)
    except asyncio.TimeoutError:
        return False
    except Exception:  # noqa: BLE001 - whatever the runtime raises for an actor that is gone
        return True
    return False


class RolloutFaults:
    """Dead rollout actors, their replacements and failed pushes, for a schedule."""

    rollouts: list[RolloutHandle]
    trainer: TrainerHandle
    queue: TransferQueue
    cfg: RunSettings
    step: int

    def _init_faults(self, respawn_rollout: Respawn | None) -> None:
        self.respawn_rollout = respawn_rollout  # None: never
        self.lost_rollouts: list[str] = []  # "<name>: <why>" of every rollout actor that died
        self._weight_link_stale = False  # a rollout actor died: re-form the broadcast group before a push
        self.num_failed_pushes = 0
        self._failed_pushes_in_a_row = 0
        self.num_lost_rollouts = 0  # rollout actors that died, over the run (checkpoints carry it)
        self.num_respawns = 0  # ... and replacements started for them
        self._respawning: set[asyncio.Task[None]] = set()  # replacements being set up
        self._joining: list[RolloutHandle] = []  # replacements set up, not on the trainer's weights yet: the next push's
        self._rollouts_changed = asyncio.Event()  # set (and replaced) whenever rollouts or replacements change
        self._weight_link: tuple[str, str | None, int] | None = None  # the rollouts' link, read at the first step

    async def _push(self, released: asyncio.Event | None = None) -> dict[str, object]:
        """One weight push to the rollout actors and the replacements joining (PolicyBase)."""
        raise NotImplementedError

    async def join_replacements(self) -> None:
        """Push the trainer's weights now to the replacements ready to join, when no
        rollout actor is left: the caller knows the trainer holds no batch (nothing
        can reach it while no actor generates), so its weights are not changing. The
        trainer may have sent this version already: it is sent again, in full."""
        if self.rollouts or not self._joining:
            return
        await self.trainer.weights_refused()
        result = await self._push()
        if "failed" in result:
            log.warning("replacement rollout actors could not join (%s); the next push retries", result["error"])

    @property
    def replacing(self) -> bool:
        """Whether a replacement rollout actor is being set up or waits to join."""
        return bool(self._respawning or self._joining)

    def _notify_rollouts(self) -> None:
        event, self._rollouts_changed = self._rollouts_changed, asyncio.Event()
        event.set()

    async def wait_for_rollouts(self) -> bool:
        """Until a rollout actor is there to generate with (a replacement joined):
        True; False when none is left and none is coming."""
        while not self.rollouts:
            if not self.replacing:
                return False
            await self._rollouts_changed.wait()
        return True

    async def lose_rollout(self, handle: RolloutHandle, err: BaseException) -> bool:
        """Whether the rollout actor behind ``handle``, which failed with ``err``,
        is gone. A dead one leaves ``rollouts`` (pushes and evaluations go on
        without it), the weight group is re-formed before the next push, and a
        replacement is started (``rollout.max_respawns``)."""
        if handle not in self.rollouts:
            return True  # known dead already (each of its groups fails on its own)
        if not await is_dead(handle):
            return False
        if handle in self.rollouts:
            self.rollouts = [h for h in self.rollouts if h is not handle]
            self._lost(handle, err)
        return True

    def _lost(self, handle: RolloutHandle, err: BaseException) -> None:
        """Count a dead rollout actor (no longer in ``rollouts``) and start its replacement."""
        self.lost_rollouts.append(f"{handle.name}: {one_line(err)}")
        self.num_lost_rollouts += 1
        self._weight_link_stale = True
        replace = self.respawn_rollout is not None and self.num_respawns < self.cfg.rollout.max_respawns
        log.warning("rollout actor %s died (%s); %d left%s", handle.name, one_line(err), len(self.rollouts),
                    ", a replacement is starting" if replace else "")
        if replace:
            self.num_respawns += 1
            task = asyncio.create_task(self._replace(handle), name=f"replace-{handle.name}")
            self._respawning.add(task)
            task.add_done_callback(self._respawning.discard)
        self._notify_rollouts()

    async def _replace(self, dead: RolloutHandle) -> None:
        """Set up a replacement for ``dead``; it waits in ``_joining`` for a push.
        One whose setup fails is not retried (counted among the lost)."""
        assert self.respawn_rollout is not None
        try:
            new = await self.respawn_rollout(dead)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - isolated on purpose: the run goes on with the actors it has
            self.lost_rollouts.append(f"the replacement of {dead.name}: {one_line(err)}")
            log.warning("the replacement of rollout actor %s failed: %s", dead.name, one_line(err))
        else:
            self._joining.append(new)
        finally:
            self._respawning.discard(asyncio.current_task())
            self._notify_rollouts()
            self._on_rollouts_changed()

    async def lost_group(self, group: GroupRequest) -> tuple[GroupReport, int]:
        """The report of a group whose rollout actor died before reporting it, and
        how many of the samples it says queued the queue dropped (``actor_died``)
        instead. The queue has its samples only if the actor put them before it
        died (a group may even be half written): pending ones are dropped there
        (counted by the queue), leased ones are being trained; otherwise they
        never reached it and the report drops them."""
        n = group.n
        uids = [f"{group.group_id}-{i}" for i in range(n)]  # as RolloutActor.generate_group names them
        try:
            await self.queue.drop(uids, ACTOR_DIED)
        except LookupError:  # never put: lost with the actor
            return GroupReport(group_id=group.group_id, num_samples=n, num_queued=0, dropped={ACTOR_DIED: n}), 0
        except RuntimeError:  # leased: the trainer has them
            return GroupReport(group_id=group.group_id, num_samples=n, num_queued=n), 0
        return GroupReport(group_id=group.group_id, num_samples=n, num_queued=n), n

    def _on_rollouts_changed(self) -> None:
        """Hook: a replacement is ready or failed (the schedule may have to stop or join it)."""

    def no_rollouts_left(self) -> ActorLostError:
        return ActorLostError(f"every rollout actor died ({'; '.join(self.lost_rollouts)}); nothing is left to "
                              "generate with; continue from the run's last checkpoint")

    async def _reform_weight_link(self, engines: list[RolloutHandle]) -> None:
        """After a rollout actor died, or with replacements joining: the weight
        link of the trainer and ``engines`` (the live actors and those joining)
        formed again where it has fixed members (``sync.link.reform_weight_link``)."""
        if not self._weight_link_stale or not engines:
            return
        try:
            await reform_weight_link(self.trainer, engines, self._weight_link)
        except WeightGroupLost as err:
            raise ActorLostError(f"a rollout actor died ({self.lost_rollouts[-1]}) and {err}; continue from "
                                 "the run's last checkpoint") from err
        self._weight_link_stale = False

    async def _failed_push(self, err: Exception, engines: list[RolloutHandle],
                           joining: Sequence[RolloutHandle] = ()) -> dict[str, object]:
        """A weight push to ``engines`` (``joining``: those of them that were to join
        with it) raised ``err``. Rollout actors that died in it leave the run (the
        live ones, maybe left paused by the push, run again; live joiners wait for
        the next push); a push the engines refused cleanly (``SyncFailed``) leaves
        them on one version. Either is counted and the run goes on: the next push
        brings every engine to the trainer's version. Anything else, or too many
        failures in a row, raises."""
        members = [h for h in engines if all(h is not j for j in joining)]
        dead = list(await asyncio.gather(*(self.lose_rollout(h, err) for h in members)))  # maybe lost meanwhile
        for h, gone in zip(joining, await asyncio.gather(*(is_dead(h) for h in joining))):
            if gone:
                self._lost(h, err)
                dead.append(True)
            else:
                self._joining.append(h)
        if joining:
            self._weight_link_stale = True  # the group may have been re-formed with them: again before the next
        if not self.rollouts and not self.replacing:
            raise self.no_rollouts_left() from err
        if any(dead):  # the push stopped short of its end: the live ones run again
            await resume_engines(self.rollouts, colocated=self.cfg.sync.colocated)
        elif not isinstance(err, SyncFailed):
            raise err
        self.num_failed_pushes += 1
        self._failed_pushes_in_a_row += 1
        if self._failed_pushes_in_a_row >= MAX_FAILED_PUSHES:
            raise err
        log.warning("weight push of step %d failed (%s); the next push retries", self.step, one_line(err))
        return {"failed": 1, "error": one_line(err)}
