"""The same actor class under the local and the Ray runtime."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading

import pytest

from actors.runtime import ACTOR_SWITCH_INTERVAL_S, Actor, make_runtime


class EchoActor(Actor):
    """Test actor: async endpoints, blocking work on its worker thread, setup errors."""

    def __init__(self, *, scale: int, fail_setup: bool = False) -> None:
        self.scale, self.fail_setup = scale, fail_setup
        self.threads: set[str] = set()

    async def setup(self) -> None:
        if self.fail_setup:
            raise ValueError("model.path: /missing does not exist")

    def _work(self, x: int) -> int:
        self.threads.add(threading.current_thread().name)
        return x * self.scale

    async def compute(self, x: int) -> int:
        return await self.blocking(self._work, x)

    async def worker_threads(self) -> list[str]:
        return sorted(self.threads)

    async def pid(self) -> int:
        return os.getpid()

    async def switch_interval(self) -> float:
        return sys.getswitchinterval()

    async def frozen(self) -> int:
        return gc.get_freeze_count()


async def _exercise(runtime_type: str) -> dict:
    rt = make_runtime(runtime_type, num_cpus=2)
    try:
        a = await rt.spawn(EchoActor, name="a", num_cpus=0.5, scale=3)
        b = await rt.spawn(EchoActor, name="b", num_cpus=0.5, scale=5)
        results = await asyncio.gather(*(a.compute(i) for i in range(20)))
        both = await rt.call_all([a, b], "compute", 2)
        with pytest.raises(Exception, match="model.path"):
            await rt.spawn(EchoActor, name="bad", num_cpus=0.5, scale=1, fail_setup=True)
        return {"results": results, "both": both, "threads": await a.worker_threads(),
                "same_process": await a.pid() == os.getpid(), "switch_interval": await a.switch_interval(),
                "frozen": await a.frozen()}
    finally:
        await rt.shutdown()


@pytest.mark.asyncio
async def test_local_runtime_runs_actors_in_process_with_one_worker_thread_each():
    out = await _exercise("local")
    assert out["results"] == [3 * i for i in range(20)] and out["both"] == [6, 10]
    assert len(out["threads"]) == 1 and out["same_process"]
    assert out["switch_interval"] == sys.getswitchinterval()  # the user's process is left as it is
    assert out["frozen"] == gc.get_freeze_count()  # ... its garbage collector too


@pytest.mark.ray
@pytest.mark.asyncio
async def test_ray_runtime_gives_the_same_results_in_other_processes():
    import ray

    assert not ray.is_initialized()
    out = await _exercise("ray")
    assert out["results"] == [3 * i for i in range(20)] and out["both"] == [6, 10]
    assert len(out["threads"]) == 1 and not out["same_process"]
    assert out["switch_interval"] == ACTOR_SWITCH_INTERVAL_S  # loop answers within 0.5 ms of a busy thread
    assert out["frozen"] > 0  # what setup left alive: out of every later full collection
    assert not ray.is_initialized()  # the cluster it started is stopped


@pytest.mark.ray
@pytest.mark.asyncio
async def test_ray_runtime_never_shuts_down_a_cluster_it_joined():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rt = make_runtime("ray", address="auto")
        a = await rt.spawn(EchoActor, name="a", num_cpus=0.5, scale=2)
        assert await a.compute(4) == 8
        await rt.shutdown()
        assert ray.is_initialized()
    finally:
        ray.shutdown()


def test_unknown_runtime_is_a_clear_error():
    with pytest.raises(ValueError, match="runtime.type"):
        make_runtime("slurm")


class FlakyActor(Actor):
    """Test actor for the process runtime: errors, overlapping calls, dying."""

    async def fail(self) -> None:
        raise KeyError("no such sample")

    async def slow(self, x: int, delay_s: float) -> int:
        await asyncio.sleep(delay_s)
        return x

    async def die(self) -> None:
        os._exit(3)

    async def unpicklable(self) -> object:
        return threading.Lock()


class StuckActor(Actor):
    """Test actor whose close never returns and whose loop is blocked."""

    async def close(self) -> None:
        await asyncio.sleep(3600)

    async def block(self) -> None:
        import time

        time.sleep(3600)  # holds the actor's loop: not even a stop message gets through


class BrokenActor(Actor):
    def __init__(self) -> None:
        raise ValueError("engine.max_num_seqs: expected int >= 1, got 0")


@pytest.mark.asyncio
async def test_process_runtime_runs_each_actor_in_its_own_process():
    out = await _exercise("process")
    assert out["results"] == [3 * i for i in range(20)] and out["both"] == [6, 10]
    assert len(out["threads"]) == 1 and not out["same_process"]
    assert out["switch_interval"] == ACTOR_SWITCH_INTERVAL_S
    assert out["frozen"] > 0  # what setup left alive: out of every later full collection


@pytest.mark.asyncio
async def test_process_runtime_errors_overlap_and_death_are_reported():
    from actors.runtime import ActorDiedError

    rt = make_runtime("process")
    try:
        with pytest.raises(ValueError, match="max_num_seqs"):
            await rt.spawn(BrokenActor, name="broken")
        a = await rt.spawn(FlakyActor, name="flaky")
        with pytest.raises(KeyError, match="no such sample") as info:
            await a.fail()
        assert any("raised in actor 'flaky'" in n for n in info.value.__notes__)
        with pytest.raises(TypeError, match="cannot be sent back"):
            await a.unpicklable()
        with pytest.raises(TypeError, match="cannot be sent"):
            await a.slow(threading.Lock(), 0)
        # calls overlap: the short one answers first
        done = []
        await asyncio.gather(*(_note(done, a.slow(x, d)) for x, d in ((1, 0.3), (2, 0.0))))
        assert done == [2, 1]
        pending = asyncio.ensure_future(a.slow(5, 30))
        with pytest.raises(ActorDiedError, match="exit code 3"):
            await a.die()
        with pytest.raises(ActorDiedError):
            await pending
        with pytest.raises(ActorDiedError):
            await a.slow(1, 0)
    finally:
        await rt.shutdown()


async def _note(done: list, call) -> None:
    done.append(await call)


@pytest.mark.asyncio
async def test_process_runtime_ends_an_actor_that_does_not_close():
    rt = make_runtime("process")
    a = await rt.spawn(StuckActor, name="stuck")
    b = await rt.spawn(StuckActor, name="blocked")
    blocked = asyncio.ensure_future(b.block())
    await asyncio.sleep(0.2)
    await asyncio.gather(a.stop(timeout_s=0.5), b.stop(timeout_s=0.5))
    assert not a.proc.is_alive() and not b.proc.is_alive()
    from actors.runtime import ActorDiedError

    with pytest.raises(ActorDiedError):
        await blocked
    await rt.shutdown()


class PreloadingActor(EchoActor):
    """Test actor whose process imports a module before its actor arrives."""

    preload = ("json.tool",)

    async def has_module(self, name: str) -> bool:
        return name in sys.modules


@pytest.mark.asyncio
async def test_process_runtime_prestarts_processes_that_import_ahead_and_ends_unused_ones():
    from actors.runtime import ProcessRuntime

    rt = ProcessRuntime()
    try:
        rt.prestart({PreloadingActor: 2})
        idle = [proc for proc, _ in rt._idle[PreloadingActor]]
        a = await rt.spawn(PreloadingActor, name="a", scale=3)
        assert await a.pid() == idle[0].pid  # the process started ahead took the actor
        assert await a.compute(2) == 6 and await a.has_module("json.tool")
        parts = await a.startup_timings()
        assert parts["boot_s"] > 0 and parts["process_s"] >= 0  # launched ahead: boot_s began before the spawn
        b = await rt.spawn(EchoActor, name="b", scale=5)  # no process ahead for this class: one of its own
        assert await b.pid() not in {p.pid for p in idle} and await b.compute(2) == 10
    finally:
        await rt.shutdown()
    assert not any(p.is_alive() for p in idle)  # the one never used too


_ENTRY = """
import asyncio
import xml.dom.minidom  # imported by this module only: in a child, the sign that it ran there
{marker}
if __name__ == "__main__":
    from actors.runtime import ProcessRuntime
    from test_runtime import PreloadingActor

    async def main():
        rt = ProcessRuntime()
        try:
            a = await rt.spawn(PreloadingActor, name="a", scale=1)
            print("child imported main:", await a.has_module("xml.dom.minidom"))
        finally:
            await rt.shutdown()
    asyncio.run(main())
"""


@pytest.mark.parametrize("marker", ["", "SPAWN_IMPORTS_MAIN = False"])
def test_a_process_child_imports_the_drivers_main_module_unless_it_says_not_to(tmp_path, marker):
    import pathlib
    import subprocess

    (tmp_path / "entry_mod.py").write_text(_ENTRY.format(marker=marker))
    here = pathlib.Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(here), str(here.parent)])}
    out = subprocess.run([sys.executable, "-m", "entry_mod"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"child imported main: {not marker}" in out.stdout
