"""The process's one event loop: reuse, foreign loops, shutdown, no leaks."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

import loop


@pytest.fixture(autouse=True)
def fresh_loop():
    loop.shutdown()
    yield
    loop.shutdown()


async def _loop_id() -> int:
    await asyncio.sleep(0)
    return id(asyncio.get_running_loop())


def _num_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def test_run_reuses_one_loop_and_it_is_uvloop():
    ids = {loop.run(_loop_id()) for _ in range(5)}
    assert ids == {id(loop.get_loop())}
    assert loop.is_uvloop()


def test_run_returns_results_and_raises_errors():
    async def boom():
        raise KeyError("x")

    assert loop.run(asyncio.sleep(0, result=42)) == 42
    with pytest.raises(KeyError):
        loop.run(boom())


def test_run_works_when_the_calling_thread_already_runs_a_loop():
    """A notebook cell: the thread runs a foreign loop; run() uses the one background thread."""
    seen: list[int] = []

    async def notebook_cell():
        seen.append(loop.run(_loop_id()))
        seen.append(loop.run(_loop_id()))
        return id(asyncio.get_running_loop())

    foreign = asyncio.run(notebook_cell())
    assert len(set(seen)) == 1 and seen[0] != foreign
    threads = [t for t in threading.enumerate() if t.name == "asyncrl-loop"]
    assert len(threads) == 1


def test_run_from_inside_the_loop_is_a_clear_error():
    async def nested():
        with pytest.raises(RuntimeError, match="use `await`"):
            loop.run(asyncio.sleep(0))

    loop.run(nested())


def test_submit_returns_a_concurrent_future_from_any_thread():
    futures = []

    def worker():
        futures.append(loop.submit(asyncio.sleep(0, result="ok")))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [f.result(timeout=5) for f in futures] == ["ok"] * 4


def test_shutdown_cancels_pending_tasks_and_is_idempotent():
    started = threading.Event()
    cancelled = threading.Event()

    async def forever():
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    fut = loop.submit(forever())
    assert started.wait(5)
    old = loop.get_loop()
    loop.shutdown()
    loop.shutdown()
    assert cancelled.is_set() and fut.cancelled()
    assert old.is_closed()
    assert loop.run(asyncio.sleep(0, result=1)) == 1  # a new loop after shutdown


def _loop_threads() -> int:
    return sum(t.name == "asyncrl-loop" for t in threading.enumerate())


def test_open_file_descriptors_stay_flat_over_10000_calls():
    # Other tests' helper threads (Ray, tqdm's monitor) may come and go meanwhile,
    # so count this module's own thread, and allow a couple of unrelated fds: a leak
    # of one per call would be thousands.
    loop.run(asyncio.sleep(0))  # the loop runs in this thread
    before = _num_fds()
    for i in range(5000):
        assert loop.run(asyncio.sleep(0, result=i)) == i
    assert _num_fds() - before <= 2
    assert _loop_threads() == 0

    loop.submit(asyncio.sleep(0)).result()  # now the loop runs on its background thread
    before = _num_fds()
    for i in range(2500):
        assert loop.submit(asyncio.sleep(0, result=i)).result() == i
        assert loop.run(asyncio.sleep(0, result=i)) == i
    assert _num_fds() - before <= 2
    assert _loop_threads() == 1
