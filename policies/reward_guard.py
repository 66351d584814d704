"""Stop a run whose reward function keeps failing, at once and with its error.

A reward that raises costs its sample only (the rollout actor counts it and drops
the group), so one bad sample never stops a run. A reward that fails on most
samples is a bug, and without this guard the run would wait for batches that never
fill until the watchdog (``run.watchdog_s``) gave up, minutes later and without the
exception. The guard keeps the last ``window`` scored samples' outcomes and stops
the run when more than ``max_share`` of them failed, once it has seen at least two
groups: a reward that fails on every sample stops the run after its first two groups.
"""

from __future__ import annotations

from collections import deque

from contracts.rollout import GroupReport

__all__ = ["RewardGuard", "RewardsFailing"]


class RewardsFailing(RuntimeError):
    """The reward function failed on more than ``policy.max_reward_error_share`` of
    the last scored samples; the message names the function and its first error."""


class RewardGuard:
    """Counts scored samples and reward failures over a sliding window of groups."""

    def __init__(self, *, name: str, max_share: float, window: int, min_samples: int) -> None:
        self.name, self.max_share, self.window, self.min_samples = name, max_share, window, min_samples
        self._groups: deque[tuple[int, int]] = deque()  # (scored, failed) per group, oldest first
        self._scored = self._failed = 0
        self.last_error: str | None = None  # the latest failure, for the watchdog's report

    def observe(self, report: GroupReport) -> None:
        """Count ``report``'s samples; raise :class:`RewardsFailing` past the share."""
        if report.reward_error is not None:
            self.last_error = report.reward_error
        if not report.num_scored:
            return
        self._groups.append((report.num_scored, report.num_reward_errors))
        self._scored += report.num_scored
        self._failed += report.num_reward_errors
        while self._scored - self._groups[0][0] >= self.window:
            scored, failed = self._groups.popleft()
            self._scored, self._failed = self._scored - scored, self._failed - failed
        if self._scored >= self.min_samples and self._failed > self.max_share * self._scored:
            raise RewardsFailing(
                f"the reward function {self.name} failed on {self._failed} of the last {self._scored} scored "
                f"samples (policy.max_reward_error_share={self.max_share:g}): {self.last_error}")
