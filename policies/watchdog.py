"""The watchdog's report: what each part of a run waits on while its trainer step
does not finish. A mixin of :class:`policies.base.PolicyBase`; the composition
root's watchdog (``run.watchdog_s``) raises :class:`NoProgressError` with it.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from policies.config import RunSettings
from policies.reward_guard import RewardGuard
from transfer_queue import TransferQueue

__all__ = ["NoProgressError", "WaitingReport"]


class NoProgressError(RuntimeError):
    """No trainer step finished within the watchdog's time (``run.watchdog_s``);
    the message says what each part of the run was waiting on."""


class WaitingReport:
    """``waiting_on`` for a schedule; subclasses add their own phrases."""

    # what it reads of the schedule (PolicyBase and the Accounting mixin own these)
    cfg: RunSettings
    queue: TransferQueue
    step: int
    in_flight: int
    rollout_dropped: Counter[str]
    reward_guard: RewardGuard

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
        """Subclasses: more on the samples being generated (a phrase that goes on the count)."""
        return ""

    def _waiting_detail(self) -> list[str]:
        """Subclasses: what else waits (admission, a weight push), a phrase each."""
        return []
