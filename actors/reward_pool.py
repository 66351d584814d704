"""RewardPool: the threads a rollout actor scores samples on, several at once.

A reward may take seconds (a judge model, a sandbox); scored one call at a time,
a step of 64 samples would wait 64 of them. The pool runs ``num_workers`` calls
at once. Its threads are daemons, never joined: a call blocked in user code
never keeps the process from ending (SIGTERM, the end of a script); the call is
abandoned with the process.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["RewardPool"]

_CLOSE_WAIT_S = 1.0  # close() waits this long for calls to end, then abandons them


def _timed(fn: Callable[..., object], args: tuple[object, ...]) -> tuple[object, float]:
    """(what ``fn(*args)`` returned or the exception it raised, its seconds)."""
    t0 = time.perf_counter()
    try:
        value: object = fn(*args)
    except Exception as err:  # noqa: BLE001 - its sample's error, counted by the caller
        value = err
    except BaseException as err:  # SystemExit and the like: an error of this sample, not the end of the actor
        value = RuntimeError(f"the reward raised {type(err).__name__}: {err}")
    return value, time.perf_counter() - t0


class RewardPool:
    """``num_workers`` daemon threads taking reward calls first come, first served.
    :meth:`submit` returns a future of (value or exception, seconds of the call
    itself, not of its wait in the queue). Threads start with the first call."""

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {num_workers}")
        self.num_workers = num_workers
        self._jobs: queue.SimpleQueue | None = None
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., object], *args: object) -> concurrent.futures.Future[tuple[object, float]]:
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                self._threads = [threading.Thread(target=self._work, args=(self._jobs,), name=f"reward-{i}",
                                                  daemon=True) for i in range(self.num_workers)]
                for thread in self._threads:
                    thread.start()
            jobs = self._jobs
        done: concurrent.futures.Future = concurrent.futures.Future()
        jobs.put((done, fn, args))
        return done

    @staticmethod
    def _work(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            done, fn, args = job
            if done.set_running_or_notify_cancel():  # a cancelled call (its sample gone) is never run
                done.set_result(_timed(fn, args))

    def close(self, wait_s: float = _CLOSE_WAIT_S) -> None:
        """Let the threads end once their calls do: idle ones are gone when this
        returns, those still in a call after ``wait_s`` are abandoned, never waited for."""
        with self._lock:
            jobs, threads, self._jobs, self._threads = self._jobs, self._threads, None, []
        for _ in threads:
            jobs.put(None)
        deadline = time.monotonic() + wait_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
