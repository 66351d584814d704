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


@pytest.mark.parametrize("where", ["the loop in this thread", "a foreign loop in this thread"])
def test_an_interrupt_with_on_interrupt_lets_the_coroutine_end_then_raises_keyboard_interrupt(where, default_sigint):
    """SIGINT (Ctrl-C, a notebook's stop button) while ``run(coro, on_interrupt=...)``
    blocks: ``on_interrupt`` runs on the loop, ``coro`` ends its own way, nothing is
    left running, then KeyboardInterrupt; Python's SIGINT handler is back after."""
    import signal

    events: list[str] = []

    async def work() -> None:
        stop = asyncio.Event()
        stopping.append(stop.set)
        await stop.wait()
        await asyncio.sleep(0.05)  # what is in progress finishes
        events.append("ended")

    def on_interrupt() -> None:
        assert loop.in_loop()
        events.append("interrupted")
        stopping[0]()

    async def cell() -> None:
        loop.run(work(), on_interrupt=on_interrupt)

    stopping: list = []
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        if where == "the loop in this thread":
            loop.run(work(), on_interrupt=on_interrupt)
        else:
            foreign = asyncio.new_event_loop()  # no SIGINT handler of its own, as Jupyter's
            try:
                foreign.run_until_complete(cell())
            finally:
                foreign.close()
    assert events == ["interrupted", "ended"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert loop.run(_tasks_left()) == 0


async def _tasks_left() -> int:
    return len(asyncio.all_tasks()) - 1
