"""How a user's reward function is called: each call on a thread of its own under
a timeout (:class:`TimedReward`), an ``async def`` one's coroutine awaited on the
process's one loop (:func:`settle`). :mod:`policies.rewards` wraps every user
function in both; the rollout actor's reward pool calls the result."""

from __future__ import annotations

import concurrent.futures
import inspect
import queue
import threading
from collections.abc import Callable

import loop

__all__ = ["TimedReward", "settle"]


class TimedReward:
    """Runs a user reward function on a daemon thread of its own and waits at
    most ``timeout_s`` for it; a call that takes longer raises ``TimeoutError``
    and its thread is abandoned (it exits when the call ends). Concurrent
    calls (the rollout actor's reward pool, ``policy.reward_workers``) each get
    a thread: an idle one from an earlier call, else a new one, so there are
    as many as calls ever ran at once plus the abandoned. So a hung function
    never holds its caller's thread. With ``max_stuck`` abandoned calls still
    running, further calls fail at once (``RuntimeError``) rather than pile up
    threads. Calls pass their arguments to ``fn`` (an adapted function: it
    checks its own result) and return its result."""

    def __init__(self, fn: Callable[..., object], *, name: str, timeout_s: float, max_stuck: int = 4) -> None:
        if not timeout_s > 0:
            raise ValueError(f"reward {name!r}: timeout_s must be > 0, got {timeout_s}")
        self.fn, self.name, self.timeout_s, self.max_stuck = fn, name, timeout_s, max_stuck
        self.num_timeouts = 0
        self._num_stuck = 0
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # the job queues of threads waiting for a call

    def __call__(self, *args: object) -> float:
        with self._lock:
            if self._num_stuck >= self.max_stuck:
                raise RuntimeError(f"reward {self.name!r}: {self._num_stuck} calls still running after timing "
                                   f"out ({self.timeout_s} s); refusing more until they end")
            if self._idle:
                jobs = self._idle.pop()
            else:
                jobs = queue.SimpleQueue()
                threading.Thread(target=self._work, args=(jobs,), name="reward-fn", daemon=True).start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        jobs.put((done, args))
        try:
            value = done.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self.num_timeouts += 1
                self._num_stuck += 1
            jobs.put(None)  # abandon this thread: it exits when the hung call ends
            raise TimeoutError(f"reward {self.name!r} took longer than {self.timeout_s} s") from None
        with self._lock:
            self._idle.append(jobs)
        return value

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                break
            done, args = job
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(self.fn(*args))
            except Exception as e:  # delivered to the caller, who counts it
                done.set_exception(e)
            except BaseException as e:  # SystemExit and the like must not end the caller
                done.set_exception(RuntimeError(f"reward {self.name!r} raised {type(e).__name__}: {e}"))
        with self._lock:  # only an abandoned thread gets None
            self._num_stuck -= 1


def settle(value: object) -> object:
    """``value``, or what it resolves to when it is awaitable (an ``async def``
    reward's coroutine): awaited on the process's one loop (``loop.submit``),
    beside every other reward call awaiting there, while this thread waits.
    Called on a reward thread, never on the loop (it would wait for itself)."""
    if not inspect.isawaitable(value):
        return value
    if loop.in_loop():
        if inspect.iscoroutine(value):
            value.close()
        raise RuntimeError("an async reward was called on the event loop's own thread; score it on a worker "
                           "thread (the rollout actor's reward pool does)")

    async def wait() -> object:
        return await value

    return loop.submit(wait()).result()
