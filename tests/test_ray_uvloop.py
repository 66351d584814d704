"""One loop everywhere: Ray actors run on uvloop, and that loop is their process's one loop.

Ray builds an async actor's loop with uvloop when it is installed
(``ray._private.async_compat.get_new_event_loop``); ``loop.adopt()`` makes it
the process's asyncrl loop. These tests look at the running loop inside a
rollout-style actor spawned by ``RayRuntime`` and inside the TransferQueue's
controller and storage actors.
"""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import textwrap

import pytest

import loop
from actors.runtime import Actor, make_runtime
from tests.helpers import make_samples
from transfer_queue import TransferQueue, TransferQueueConfig

ray = pytest.importorskip("ray")
pytest.importorskip("uvloop")

pytestmark = pytest.mark.timeout(120)

UVLOOP = "uvloop.Loop"  # module.qualname of uvloop's loop class


class LoopProbeActor(Actor):
    """A rollout-style actor that reports the loop its coroutines run on."""

    async def loop_class(self) -> str:
        running = type(asyncio.get_running_loop())
        return running.__module__ + "." + running.__qualname__

    async def loop_is_adopted_uvloop(self) -> tuple[bool, bool]:
        return loop.is_uvloop(), loop.get_loop() is asyncio.get_running_loop()


@pytest.mark.ray
@pytest.mark.asyncio
async def test_ray_runtime_actor_runs_on_uvloop_as_its_process_loop(ray_cluster) -> None:
    rt = make_runtime("ray", address="auto")  # joins the cluster the fixture started
    try:
        actor = await rt.spawn(LoopProbeActor, name="probe", num_cpus=0.5)
        assert await actor.loop_class() == UVLOOP
        assert await actor.loop_is_adopted_uvloop() == (True, True)
    finally:
        await rt.shutdown()
    assert ray.is_initialized()  # a joined cluster is left running


@pytest.mark.ray
@pytest.mark.asyncio
async def test_ray_transfer_queue_actors_run_on_uvloop_and_put_get_ack_still_work(ray_cluster) -> None:
    tq = await TransferQueue.create(TransferQueueConfig(deployment="ray", capacity=16, num_storage_units=2))
    try:
        actors = [tq._d._controller, *tq._d.units]
        infos = await asyncio.gather(*(a.loop_info.remote() for a in actors))
        assert infos == [(UVLOOP, True)] * 3  # (running loop's class, it is the adopted process loop)

        samples = make_samples(2, 2)
        await tq.put(samples)
        batch = await tq.get("trainer", 4, sampler="grpo_group", group_size=2)
        assert batch.samples == samples
        await tq.ack(batch.batch_id)
        stats = await tq.statistics_async()
        assert (stats.put, stats.delivered) == (4, 4)
    finally:
        await tq.shutdown()


def test_adopting_a_plain_asyncio_loop_keeps_it_and_warns_when_uvloop_is_installed() -> None:
    # In a child process: adopt() replaces this process's loop, which other tests use.
    code = textwrap.dedent(
        """
        import asyncio, logging
        import loop

        async def main():
            running = asyncio.get_running_loop()
            assert loop.adopt() is running and loop.get_loop() is running and loop.in_loop()
            assert not loop.is_uvloop()
            loop.adopt()  # adopting the same loop again warns only once

        logging.basicConfig(format="%(levelname)s %(message)s")
        asyncio.run(main())
        """
    )
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=repo)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "not uvloop" in warnings[0] and "RAY_USE_UVLOOP" in warnings[0]
