"""Staleness lives here: how many samples rollout may start before the next sync.

Let

    B = batch_size * require_batches        samples the trainer takes per step
    K = trigger_parameter_sync_step         trainer steps between weight syncs
    s = staleness_threshold                 extra fraction generated ahead

Each sync window (the time between two weight syncs) may admit

    window_budget = ceil((1 + s) * K * B)

samples *including* those carried over from earlier windows (admitted but not
yet trained or dropped when the window opened):

    admit a group of n  iff  carried + admitted_in_window + n <= window_budget

The four modes this spans:

    on-policy                  K = 1, s = 0: generate exactly one batch, train, sync.
    stream off-policy          K > 1, s = 0: K batches on one version, trained as they stream.
    async with stale samples   s > 0, partial_rollout off: up to s*K*B samples run ahead.
    async, partial rollouts    s > 0, partial_rollout on: in-flight samples are interrupted
                               at a sync and resumed on the new weights.

The budget bounds how many samples are ahead of training, not how old one
slow sample can get: a generation that keeps running across syncs (partial
rollouts) spans several versions. The age bound is the trainer's
``max_staleness``: the queue drops anything older, counted, and ``release``
gives the slot back so a fresh sample replaces it.
"""

from __future__ import annotations

import asyncio
import math

__all__ = ["Admission", "window_budget"]


def window_budget(batch_size: int, require_batches: int, trigger_parameter_sync_step: int,
                  staleness_threshold: float) -> int:
    """Samples one sync window may hold in flight or queued (formula above)."""
    if min(batch_size, require_batches, trigger_parameter_sync_step) < 1 or staleness_threshold < 0:
        raise ValueError("batch_size, require_batches, trigger_parameter_sync_step must be >= 1 "
                         "and staleness_threshold >= 0")
    need = batch_size * require_batches * trigger_parameter_sync_step
    return math.ceil((1.0 + staleness_threshold) * need - 1e-9)


class Admission:
    """The one admission counter. ``acquire(n)`` waits until a group of ``n``
    may start; ``open_window(outstanding)`` is called at every weight sync
    with the number of samples still in flight or queued; ``release(n)``
    returns the slots of dropped samples."""

    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"admission budget must be >= 1, got {budget}")
        self.budget = budget
        self.carried = 0
        self.admitted_in_window = 0
        self.num_admitted = 0
        self._changed = asyncio.Condition()
        self._closed = False

    def can_admit(self, n: int) -> bool:
        return self.carried + self.admitted_in_window + n <= self.budget

    async def acquire(self, n: int) -> bool:
        """Wait until ``n`` samples may start; False once closed."""
        if n > self.budget:
            raise ValueError(f"a group of {n} never fits the window budget {self.budget}")
        async with self._changed:
            await self._changed.wait_for(lambda: self._closed or self.can_admit(n))
            if self._closed:
                return False
            self.admitted_in_window += n
            self.num_admitted += n
            return True

    async def open_window(self, outstanding: int) -> None:
        """A weight sync happened; ``outstanding`` samples carry over."""
        async with self._changed:
            self.carried, self.admitted_in_window = outstanding, 0
            self._changed.notify_all()

    async def release(self, n: int) -> None:
        """``n`` admitted samples were dropped before training: their slots
        go back, so a dropped sample is replaced instead of stalling the window."""
        async with self._changed:
            from_carried = min(n, self.carried)
            self.carried -= from_carried
            self.admitted_in_window = max(0, self.admitted_in_window - (n - from_carried))
            self._changed.notify_all()

    def state_dict(self, release: int = 0) -> dict[str, int]:
        """The counter's state (for a run checkpoint), as if ``release`` more
        admitted samples had been dropped (``release(release)``) first."""
        from_carried = min(release, self.carried)
        return {"budget": self.budget, "carried": self.carried - from_carried,
                "admitted_in_window": max(0, self.admitted_in_window - (release - from_carried)),
                "num_admitted": self.num_admitted}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Take a checkpoint's state; nobody may be waiting in ``acquire`` yet."""
        if state["budget"] != self.budget:
            raise ValueError(f"the checkpoint's admission window is {state['budget']} samples, this run's "
                             f"{self.budget}: batch size, staleness and sync settings must match")
        self.carried, self.admitted_in_window = state["carried"], state["admitted_in_window"]
        self.num_admitted = state["num_admitted"]

    async def close(self) -> None:
        async with self._changed:
            self._closed = True
            self._changed.notify_all()
