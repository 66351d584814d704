"""The fully-async policy: one coroutine schedule on the driver's loop.

    prompts ──► feeder ──(admission.acquire(n))──► group task × G              trainer loop
                  │ waits for: a free slot in the       │ rollout.generate_group      │ trainer.train_step(request)
                  │ sync window (policies.admission)    │   the actor generates,      │   the trainer takes whole,
                  │ unblocked by: a sync, a drop        │   resumes across syncs,     │   not too stale groups from
                  │                                     │   scores and puts the group │   the TransferQueue, trains,
                  │                                     │   into the TransferQueue    │   acks; reports counts
                  │                                     │ reports counts; drops →     │ every K steps:
                  ▼                                     ▼   admission.release          ▼
    weight sync (sync.link → sync.sequence): encode + publish in the trainer → [each engine checks
        the payload while generating] → each engine swaps it in between two decode steps, its
        running generations aborted (partials stay in the rollout actors, resumed), kept on their
        KV, or recomputed (``sync.in_flight``) → versions compared; admission.open_window
        (with overlap_push, a task: the trainer's next step starts once the encode is done)

An evaluation (``policy.eval_every``) runs beside training on the weights of its
step: pushes wait for it, the trainer goes on for up to ``policy.eval_overlap_steps``
steps (at most ``max_staleness - 1``; each opens its sync window without a push), then
waits at its push.

The policy holds requests, reports and counters; samples go rollout actor →
TransferQueue → trainer actor, weights trainer → engines.

Feeder and group tasks run in the background for the life of the policy; the
trainer loop runs inside :meth:`train` so a notebook can call ``train(steps=10)``
repeatedly (``settle()`` before the loop stops: the last push must not be left
half way). A background task that dies re-raises in :meth:`train`.
Accounting invariant, checked every step: produced == trained + dropped + pending.

Which groups a step trains (``policy.batch_order``): ``admission`` (default), the
oldest groups admitted that are neither trained nor dropped, whole and in that
order; the step waits until all of them are generated and queued (``_order``:
group id -> None while generating, its oldest token version once reported). A
group among them that the queue would drop as stale at this step is skipped
(and dropped now, so its slots go back), and so is one lost with a storage unit
(the queue dropped it: ``_step`` picks again). ``completion``: the first whole groups
to finish, which trains groups with a long sample later, staler, or never (the
length bias ``batch_order`` documents). A resumed run trains the restored
queue's groups first: the checkpoint's order, then any others the queue holds.

A rollout actor that dies takes its groups with it: each is counted dropped
(``actor_died``, its admission slots go back) unless the actor had put it
into the queue already, and the feeder goes on with the actors left
(``PolicyBase.lose_rollout``). Its replacement (``rollout.max_respawns``)
joins at the next push, or at once when none is left (the trainer then waits
for a batch that only it can make: :meth:`_train_once` sees that and joins it);
when none is left and none is coming, :meth:`train` raises.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from typing import Any

import msgspec

from contracts.handles import RolloutHandle
from transfer_queue import QueueStats

from contracts.rollout import GroupReport, GroupRequest
from contracts.training import BatchRequest, StepReport
from policies.admission import Admission, window_budget
from policies.base import AccountingError, PolicyBase

__all__ = ["FullyAsyncPolicy"]

log = logging.getLogger(__name__)

# How often a trainer step that waits for its batch looks for samples the queue dropped (stale, lost).
_DROP_POLL_S = 0.25
_UNRECORDED_STEP_WAIT_S = 30.0  # how long a stopped run waits for a step its trainer took unasked


# Why the queue drops admitted samples before training: too old (its trainer-side staleness
# filter), or lost with a storage unit. Their admission slots go back.
_QUEUE_DROPS = ("stale", "stale_group", "storage_lost")


def _queue_drops(stats: QueueStats) -> int:
    """Samples the queue dropped after admission (``_QUEUE_DROPS``), ever."""
    return sum(stats.dropped_by_reason.get(reason, 0) for reason in _QUEUE_DROPS)


class FullyAsyncPolicy(PolicyBase):
    """Rollout and training run at once; generation never runs more than the
    admission window ahead of training, and every ``trigger_parameter_sync_step``
    trainer steps the engines get the new weights (interrupted generations resume)."""

    def _init_schedule(self) -> None:
        super()._init_schedule()
        p = self.cfg.policy
        self.admission = Admission(window_budget(self.cfg.batch_size, p.require_batches,
                                                 p.trigger_parameter_sync_step, p.staleness_threshold))
        self._feeder: asyncio.Task[None] | None = None
        self._groups: set[asyncio.Task[None]] = set()
        self._load = Counter[str]()  # groups in flight, by rollout actor name
        self._failure: asyncio.Future[None] | None = None
        self._sync: asyncio.Task[None] | None = None  # the weight push in flight, if any
        self._sync_step = 0  # ... and the step whose weights it pushes
        self._released_queue_drops = 0  # the queue's drops (_QUEUE_DROPS) whose admission slots went back
        self._push_owed = False  # a push came due while an evaluation ran: the next step makes it
        self._steps_beside_eval = 0  # steps trained since then
        self._in_order = p.batch_order == "admission"
        # batch_order=admission: every group admitted and not yet trained or dropped, in admission
        # order: None while it is generating, the oldest version of its tokens once queued whole
        self._order: dict[str, int | None] = {}
        self._reported = asyncio.Event()  # set on every group report: the step may have its groups now
        self._batch_groups: list[str] | None = None  # the groups the step being requested trains
        self._adopt_queued = False  # resumed: the restored queue's groups not in ``_order`` join it first
        self._storage_lost_seen = 0  # the queue's storage_lost drops when ``_order`` was last checked against it

    async def _start_background(self) -> None:
        if self._feeder is None:
            if self._adopt_queued:
                await self._adopt_queue_groups()
            self._failure = asyncio.get_running_loop().create_future()
            self._feeder = asyncio.create_task(self._feed(), name="feeder")

    def rollout_idle(self) -> bool:
        """No group in flight and the feeder waiting for a slot of a full window:
        nothing wakes it before the next step (a sync, a drop) or :meth:`close`."""
        n = self.cfg.rollout.n
        feeder_parked = self._feeder is None or self._feeder.done() or not self.admission.can_admit(n)
        return not self._groups and self.in_flight == 0 and feeder_parked

    def background_tasks(self) -> list[asyncio.Task[None]]:
        return [t for t in [self._feeder, *self._groups, *self._respawning] if t is not None and not t.done()]

    def _fail(self, err: BaseException) -> None:
        assert self._failure is not None
        if not self._failure.done():
            self._failure.set_exception(err)

    async def _feed(self) -> None:
        """Start prompt groups as admission allows, on the least-loaded actor."""
        n = self.cfg.rollout.n
        try:
            for gid in itertools.count():
                if not await self.admission.acquire(n):
                    return
                if not await self.wait_for_rollouts():  # every one died, none coming: train() raises that
                    return
                actor = min(self.rollouts, key=lambda h: self._load[h.name])
                group = self.next_group(gid)
                if self._in_order:
                    self._order[group.group_id] = None
                self._load[actor.name] += 1
                task = asyncio.create_task(self._run_group(actor, group), name=f"group-{gid}")
                self._groups.add(task)
                task.add_done_callback(self._groups.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._fail(err)

    async def _run_group(self, actor: RolloutHandle, group: GroupRequest) -> None:
        try:
            self.group_sent(group, actor.name)
            release, lost = 0, False
            try:
                report = await actor.generate_group(group)
            except Exception as err:
                if not await self.lose_rollout(actor, err):
                    raise
                report, release = await self.lost_group(group)
                lost = True
            self._on_reported(report, whole=report.num_queued == group.n and not lost)
            kept = self.on_group(report, actor.name)
            if kept < group.n or release:
                await self.admission.release(group.n - kept + release)
            if not self.rollouts and not self.replacing:
                self._fail(self.no_rollouts_left())
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._fail(err)
        finally:
            self._load[actor.name] -= 1

    def _on_reported(self, report: GroupReport, whole: bool) -> None:
        """A group came back: queued whole, it waits for its turn; otherwise (dropped by its
        actor, lost with it, the queue's by now or the trainer's) it leaves the order."""
        if report.group_id in self._order:
            if whole:
                self._order[report.group_id] = report.min_version
            else:
                del self._order[report.group_id]
            self._reported.set()

    def batch_request(self) -> BatchRequest:
        request = super().batch_request()
        if self._batch_groups is None:
            return request
        return msgspec.structs.replace(request, group_ids=self._batch_groups)

    async def _oldest_groups(self) -> dict[str, int]:
        """The groups the next step trains (batch_order=admission): the oldest ones admitted,
        once each is queued whole. One the queue would drop as stale at this step is left
        out, and dropped now: its slots go back, so a full window still admits its replacement."""
        p = self.cfg.policy
        k = self.cfg.batch_size * p.require_batches // self.cfg.rollout.n
        while True:
            self._reported.clear()
            picked: list[str] = []
            stale: list[str] = []
            for gid, version in self._order.items():
                if version is None:  # generating: the groups after it wait for it
                    break
                # the queue's test (transfer_queue.samplers.is_stale) at the get's current_version
                if self.step - version > p.max_staleness:
                    stale.append(gid)
                    continue
                picked.append(gid)
                if len(picked) == k:
                    break
            for gid in stale:
                del self._order[gid]
            if stale:
                await self.queue.drop_stale(current_version=self.step, max_staleness=p.max_staleness)
                await self._release_queue_drops()
            if len(picked) == k:
                return {gid: self._order.pop(gid) for gid in picked}  # type: ignore[misc]
            await self._reported.wait()

    async def _step(self) -> StepReport:
        """The trainer step: with batch_order=admission, once its groups are queued. A
        storage unit lost meanwhile (its node died) may take some of them along: the queue
        refuses to hand those out, and the step picks again from what it holds."""
        if not self._in_order:
            self._batch_groups = None
            return await super()._train_once()
        picked: dict[str, int] = {}
        while True:
            lost = await self._storage_lost()
            if lost != self._storage_lost_seen:
                await self._forget_lost_groups(picked)
                self._storage_lost_seen = lost
                await self._release_queue_drops()  # their slots: the groups that replace them may start now
            picked = await self._oldest_groups()
            self._batch_groups = list(picked)
            try:
                return await super()._train_once()
            except Exception:
                if await self._storage_lost() == lost:
                    raise

    async def _storage_lost(self) -> int:
        return (await self.queue.statistics_async()).dropped_by_reason.get("storage_lost", 0)

    async def _forget_lost_groups(self, picked: dict[str, int]) -> None:
        """Samples were lost with a storage unit (dropped, counted by the queue): ``picked``
        go back to the head of the order, and the groups queued whole that the queue no
        longer holds leave it (never named: the queue would refuse them)."""
        generating = {gid for gid, v in self._order.items() if v is None}  # a report meanwhile: put before it
        queued = {gid for gid, size, _ in await self.queue.pending_groups() if size == self.cfg.rollout.n}
        order = {**picked, **self._order}
        self._order = {gid: v for gid, v in order.items() if v is None or gid in generating or gid in queued}
        if len(self._order) < len(order):
            log.warning("%d queued groups were lost with a storage unit (counted dropped: storage_lost); the "
                        "steps train the next oldest", len(order) - len(self._order))

    async def _adopt_queue_groups(self) -> None:
        """Resumed: the groups the restored queue holds whole go first, in the checkpoint's
        order (those it still has), then the others (queued before their report came) as
        they arrived; a group it no longer holds whole is never named."""
        n = self.cfg.rollout.n
        queued = {gid: version for gid, size, version in await self.queue.pending_groups() if size == n}
        saved = {gid: version for gid, version in self._order.items() if gid in queued}
        self._order = {**saved, **{gid: v for gid, v in queued.items() if gid not in saved}}
        self._adopt_queued = False

    def state_dict(self, queue: QueueStats) -> dict[str, object]:
        state = super().state_dict(queue)
        # the groups queued whole, in admission order (the resumed run trains them first, in it)
        state["group_order"] = [[gid, v] for gid, v in self._order.items() if v is not None]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self._in_order:  # a checkpoint without an order (older ones): the queue's arrival order alone
            self._order = {gid: version for gid, version in state.get("group_order", [])}
            self._adopt_queued = True

    async def _train_once(self) -> StepReport:
        """One trainer step, unless a background task failed: then that error is
        raised here, after the step if the trainer already holds its batch (a
        step the trainer acknowledges is one the run counts: nothing trained uncounted)."""
        assert self._failure is not None
        if self._failure.done():
            self._failure.result()  # no step after a background failure
        step = asyncio.ensure_future(self._step())  # a wait for its groups is polled as the get is
        waits: list[asyncio.Future[Any]] = [step, self._failure]
        try:
            while not (await asyncio.wait(waits, timeout=_DROP_POLL_S,
                                          return_when=asyncio.FIRST_COMPLETED))[0]:
                # a get that waits may be dropping stale samples: their slots go back now, not
                # when the step ends (a window full of them would leave it nothing to wait for)
                await self._release_queue_drops()
                if not self.rollouts and self._joining and not await self._trainer_holds_a_batch():
                    await self._push_finished()  # one push at a time
                    await self.join_replacements()  # no producer, no batch: the trainer's weights hold still
            if not step.done() and await self._trainer_holds_a_batch():
                await step  # it trains on it now (in another process a cancel would not stop that)
        except BaseException:  # cancelled (the run's watchdog), or the poll failed: the trainer's get ends too
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
            raise
        if not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
            await self._count_an_unrecorded_step()
            self._failure.result()  # re-raises the background error here
        return step.result()

    async def check_accounting(self) -> int:
        """The step's accounting, after any background failure: a report that did not add
        up failed its group's task first, and is what went wrong first."""
        failure = self._failure
        if failure is not None and failure.done() and isinstance(failure.exception(), AccountingError):
            failure.result()
        return await super().check_accounting()

    async def _count_an_unrecorded_step(self) -> None:
        """A trainer in another process may have taken its batch just as the step
        was given up here (the cancel does not reach it): it trains and acknowledges
        it unrecorded. Wait (bounded) for its lease to settle, then count what it
        acknowledged as trained, so the stopped run's accounting holds."""
        deadline = time.monotonic() + _UNRECORDED_STEP_WAIT_S
        while await self._trainer_holds_a_batch() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        consumer = (await self.queue.statistics_async()).consumers.get(self.consumer)
        if consumer is not None and consumer.delivered > self.trained:
            self.trained = consumer.delivered

    async def _trainer_holds_a_batch(self) -> bool:
        stats = await self.queue.statistics_async()
        consumer = stats.consumers.get(self.consumer)
        return consumer is not None and consumer.in_flight > 0

    @property
    def overlap_push(self) -> bool:
        if self.cfg.policy.overlap_push is not None:
            return self.cfg.policy.overlap_push

        def index(d: str) -> str:  # "cuda" is the first GPU: the same as "cuda:0"
            return d if ":" in d or d == "cpu" else f"{d}:0"
        return index(self.cfg.trainer.device) != index(self.cfg.rollout.engine.device)

    async def _after_step(self) -> None:
        """Every K steps, push the weights. With ``overlap_push`` the trainer
        waits only until they are encoded: the push (engines paused, apply,
        resume) runs on while it takes its next step. One push at a time.
        While an evaluation runs on the engines' weights, the push due waits for
        it and the trainer goes on, for up to ``policy.eval_overlap_steps`` steps."""
        if self.step % self.cfg.policy.trigger_parameter_sync_step != 0 and not self._push_owed:
            return
        if self.evaluating() and self._steps_beside_eval < self._eval_overlap_steps:
            # the push waits; its window opens all the same, so rollout (on the evaluated
            # weights, samples aging by a version a step: max_staleness bounds them) feeds the steps
            self._steps_beside_eval += 1
            self._push_owed = True
            await self._open_window()
            return
        self._push_owed, self._steps_beside_eval = False, 0
        if not self.overlap_push:
            await self.sync_weights()
            await self._open_window()
        else:
            await self._push_finished()
            released = asyncio.Event()
            self._sync = asyncio.create_task(self._sync_and_open(released), name=f"sync-{self.step}")
            self._sync_step = self.step
            encoded = asyncio.create_task(released.wait())
            await asyncio.wait([encoded, self._sync], return_when=asyncio.FIRST_COMPLETED)
            encoded.cancel()
            if self._sync.done():
                await self._push_finished()  # finished already, or failed: raise here

    @property
    def _eval_overlap_steps(self) -> int:
        """Steps the trainer takes beside an evaluation: ``policy.eval_overlap_steps``, at most
        ``max_staleness - 1``, so what rollout generated on the evaluated weights stays trainable."""
        p = self.cfg.policy
        return min(p.eval_overlap_steps, max(0, p.max_staleness - 1))

    async def _sync_and_open(self, released: asyncio.Event) -> None:
        try:
            await self.sync_weights(released)
            await self._open_window()
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._fail(err)  # a trainer waiting for a batch hears of it too
            raise

    async def settle(self, step: int | None = None) -> None:
        await super().settle(step)
        if step is None and self._push_owed:  # a push left to the step after an evaluation: made now
            await self._after_step()
            await self._push_finished()

    async def _push_finished(self, step: int | None = None) -> None:
        if self._sync is None or (step is not None and self._sync_step > step):
            return
        task, self._sync = self._sync, None
        await task

    def _push_settled(self, step: int) -> bool:
        return self._sync is None or self._sync_step > step or self._sync.done()

    def _on_rollouts_changed(self) -> None:
        if not self.rollouts and not self.replacing and self._failure is not None:
            self._fail(self.no_rollouts_left())

    def _rollout_detail(self) -> str:
        lost = f"; died: {'; '.join(self.lost_rollouts)}" if self.lost_rollouts else ""
        coming = (f"; replacements: {len(self._respawning)} starting, {len(self._joining)} waiting to join"
                  if self.replacing else "")
        return (" (groups per actor: " + ", ".join(str(self._load[h.name]) for h in self.rollouts) + lost +
                coming + ")")

    def _waiting_detail(self) -> list[str]:
        a = self.admission
        free = a.budget - a.carried - a.admitted_in_window
        sync = "" if self._sync is None or self._sync.done() else f"; a weight push of step {self._sync_step} is running"
        lines = [f"admission: {a.carried} carried + {a.admitted_in_window} admitted of a window of {a.budget} "
                 f"({free} free; a group needs {self.cfg.rollout.n}){sync}"]
        generating = next((gid for gid, v in self._order.items() if v is None), None)
        if self._in_order and generating is not None:
            ready = list(self._order.values()).index(None)
            lines.append(f"batch order: admission; the step's groups are the oldest admitted: {ready} ahead of "
                         f"group {generating} are queued, which is still generating")
        return lines

    async def _open_window(self) -> None:
        """A sync happened: a new window carries what is outstanding now. Queue drops
        until now are not outstanding: none of them is released again later."""
        in_flight = self.in_flight  # read first: a group put meanwhile counts twice, never not at all
        stats = await self.queue.statistics_async()
        self._released_queue_drops = _queue_drops(stats)
        await self.admission.open_window(in_flight + stats.pending + stats.in_flight)

    async def _release_queue_drops(self) -> None:
        """Give back the admission slots of samples the queue dropped (stale, lost) since the
        last release (or window): counted from the queue's own totals, so none twice."""
        total = _queue_drops(await self.queue.statistics_async())
        new, self._released_queue_drops = total - self._released_queue_drops, max(total, self._released_queue_drops)
        if new > 0:  # counted before the await: a window opened meanwhile resets the count, not this
            await self.admission.release(new)

    async def _on_drop_after_queue(self, n: int) -> None:
        await self._release_queue_drops()

    async def close(self) -> None:
        await self.admission.close()
        tasks = [t for t in [self._feeder, self._sync, *self._groups] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
        if self._failure is not None and self._failure.done():
            self._failure.exception()  # already raised in train(); mark it retrieved
        self._feeder = None
        await super().close()
