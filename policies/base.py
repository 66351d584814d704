"""What every schedule shares: prompt groups, accounting, batches, weight syncs, metrics.

A policy owns the counters of the accounting invariant

    produced == trained + dropped + pending

where ``produced`` counts samples that came back from rollout, ``dropped``
counts samples removed before training (by reason), and ``pending`` is what
waits in the TransferQueue (queued or handed out and not yet acknowledged).
"""

from __future__ import annotations

import abc
import asyncio
import random
import time
from collections import Counter
from typing import Any

from actors.rollout import GroupRequest
from transfer_queue.sample import Sample

__all__ = ["PolicyBase", "AccountingError"]


class AccountingError(AssertionError):
    """produced != trained + dropped + pending: a sample was lost or counted twice."""


class PolicyBase(abc.ABC):
    """Shared machinery; subclasses decide *when* rollout, training and sync happen."""

    consumer = "trainer"

    def __init__(self, cfg: Any, *, rollouts: list[Any], trainer: Any, queue: Any, task: Any,
                 weight_sync: Any) -> None:
        self.cfg, self.rollouts, self.trainer, self.queue, self.task = cfg, rollouts, trainer, queue, task
        # coroutine fn: (rollouts, trainer, released=None) -> dict of sync metrics; sets ``released``
        # (an asyncio.Event) once the trainer may step again (see sync.sequence.sync_weights)
        self.weight_sync = weight_sync
        self.rng = random.Random(cfg.run.seed)
        self.step = 0  # trainer steps done == trainer weight version
        self.produced = 0
        self.trained = 0
        self._in_flight = 0
        self._t_rollout_busy_s = 0.0
        self._t_busy_since = 0.0
        self.dropped: Counter[str] = Counter()
        self._t_start = time.perf_counter()
        self._t_trainer_busy_s = 0.0
        self.last_sync: dict[str, Any] = {}  # a finished sync whose step has no record yet
        self._record: tuple[int, dict[str, Any]] | None = None  # (step, metrics) of the latest step
        self._books = asyncio.Lock()

    # -- prompts and groups -------------------------------------------------

    def next_group(self, gid: int) -> GroupRequest:
        prompt = self.task.sample_prompts(self.rng, 1)[0]
        return GroupRequest(group_id=f"g{gid}", prompt_ids=list(prompt.prompt_ids),
                            n=self.cfg.rollout.n, meta=dict(prompt.meta))

    async def put_group(self, samples: list[Sample]) -> int:
        """Queue a finished group, or drop it whole (counted) when any member
        failed: the trainer only takes complete groups. Returns samples kept.

        The put and the counter move together under ``_books`` so that an
        accounting check never sees one without the other (the queue's
        capacity is at least the admission budget, so the put never waits
        for space while holding it)."""
        if all(s.finish_reason in ("stop", "length") and s.reward is not None for s in samples):
            async with self._books:
                await self.queue.put(samples)
                self.produced += len(samples)
            return len(samples)
        self.produced += len(samples)
        for s in samples:
            self.dropped[{"error": "reward_error", "abort": "aborted"}.get(
                s.finish_reason or "", "group_incomplete")] += 1
        return 0

    async def get_batch(self) -> Any:
        p = self.cfg.policy
        batch = await self.queue.get(
            consumer=self.consumer, batch_size=self.cfg.batch_size * p.require_batches,
            sampler="grpo_group", group_size=self.cfg.rollout.n,
            current_version=self.step, max_staleness=p.max_staleness)
        for reason, n in batch.dropped.items():
            self.dropped[reason] += n
            await self._on_drop_after_queue(n)
        return batch

    async def _on_drop_after_queue(self, n: int) -> None:
        """Hook: samples the queue dropped (stale) after they were admitted."""

    @property
    def in_flight(self) -> int:
        """Samples being generated now."""
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        # Rollout is busy while anything is in flight: integrate that time.
        now = time.perf_counter()
        if self._in_flight > 0:
            self._t_rollout_busy_s += now - self._t_busy_since
        self._in_flight, self._t_busy_since = value, now

    def rollout_busy_s(self) -> float:
        busy = self._t_rollout_busy_s
        if self._in_flight > 0:
            busy += time.perf_counter() - self._t_busy_since
        return busy

    async def outstanding(self) -> int:
        """Samples admitted and not yet trained or dropped (a group being put
        counts twice for a moment: admission errs on the safe side)."""
        async with self._books:
            return self.in_flight + await self.pending()

    async def pending(self) -> int:
        """Samples in the queue: waiting, or handed out and not yet acknowledged."""
        stats = await self.queue.statistics_async()
        return stats.pending + stats.in_flight

    async def check_accounting(self) -> int:
        """Raise :class:`AccountingError` unless produced == trained + dropped + pending;
        returns pending."""
        async with self._books:
            pending = await self.pending()
            total_dropped = sum(self.dropped.values())
            if self.produced != self.trained + total_dropped + pending:
                raise AccountingError(f"produced={self.produced} != trained={self.trained} + "
                                      f"dropped={total_dropped} + pending={pending}")
        return pending

    # -- the trainer side ---------------------------------------------------

    @abc.abstractmethod
    async def _next_batch(self) -> Any:
        """Wait for the next batch to train on."""

    @abc.abstractmethod
    async def _after_step(self) -> None:
        """Called after every trainer step (weight sync decisions live here)."""

    async def _start_background(self) -> None:
        """Start whatever runs beside the trainer loop (nothing by default)."""

    async def sync_weights(self, released: asyncio.Event | None = None) -> None:
        """Push this step's weights to the engines; its metrics go into this
        step's record (filled in later if the sync outlives the step)."""
        step, t0 = self.step, time.perf_counter()
        extra = {} if released is None else {"released": released}
        result = dict(await self.weight_sync(self.rollouts, self.trainer, **extra))
        result["sync_s"] = time.perf_counter() - t0
        if self._record is not None and self._record[0] == step:
            self._record[1].update({f"sync/{k}": v for k, v in result.items()})
        else:
            self.last_sync = result

    async def settle(self, step: int | None = None) -> None:
        """Wait for work that outlives a step (a weight push still running),
        only that of steps up to ``step`` if given: call it before this loop
        stops, so no engine stays paused meanwhile, and before reading a
        step's record as final."""

    async def train(self, num_steps: int) -> list[dict[str, Any]]:
        """Run ``num_steps`` trainer steps; returns one metrics dict per step."""
        await self._start_background()
        out = []
        for _ in range(num_steps):
            t0 = time.perf_counter()
            batch = await self._next_batch()
            t1 = time.perf_counter()
            samples: list[Sample] = batch.samples
            lags = [self.step - s.min_version for s in samples]
            train_metrics = await self.trainer.train_step(samples)
            await self.queue.ack(batch.batch_id)
            self.trained += len(samples)
            self.step += 1
            t2 = time.perf_counter()
            await self._after_step()
            t3 = time.perf_counter()
            self._t_trainer_busy_s += t2 - t1
            pending = await self.check_accounting()
            record = self._step_metrics(samples, lags, train_metrics, pending, wait_s=t1 - t0,
                                        train_s=t2 - t1, after_s=t3 - t2)
            self.last_sync, self._record = {}, (self.step, record)
            out.append(record)
        return out

    def _step_metrics(self, samples: list[Sample], lags: list[int], train: dict[str, float],
                      pending: int, *, wait_s: float, train_s: float, after_s: float) -> dict[str, Any]:
        elapsed = time.perf_counter() - self._t_start
        num_tokens = sum(len(s.response_ids) for s in samples)
        partial = [s for s in samples if s.num_resumes > 0]
        step_s = wait_s + train_s + after_s
        return {
            "step": self.step,
            "version": self.step,
            "reward": sum(s.reward or 0.0 for s in samples) / len(samples),
            "staleness_mean": sum(lags) / len(lags),
            "staleness_max": max(lags),
            "partial_ratio": len(partial) / len(samples),
            "max_resumes": max((s.num_resumes for s in samples), default=0),
            "max_resume_span": max((s.max_version - s.min_version for s in samples), default=0),
            "response_len_mean": num_tokens / len(samples),
            "samples_per_s": self.trained / elapsed,
            "tokens_per_s_step": num_tokens / step_s if step_s > 0 else 0.0,
            "trainer_idle_ratio": 1.0 - self._t_trainer_busy_s / elapsed,
            "rollout_idle_ratio": max(0.0, 1.0 - self.rollout_busy_s() / elapsed),
            "wait_s": wait_s,
            "train_s": train_s,
            "produced": self.produced,
            "trained": self.trained,
            "pending": pending,
            "dropped": dict(self.dropped),
            "elapsed_s": elapsed,
            **{f"train/{k}": v for k, v in train.items()},
            **{f"sync/{k}": v for k, v in self.last_sync.items()},
        }

    async def close(self) -> None:
        """Stop background work; the queue and actors belong to the caller."""
