"""A real rollout actor (built-in engine, tiny model) generating two groups,
one with a short prompt and one with a long one, through 1-5 weight syncs at
random points (seeded): each sync aborts what is in flight, pushes a real
weight update (a WeightSender on a trainer-side copy with a small change),
and resumes. Whatever the points:

- no response exceeds ``max_response_tokens``, however often it was resumed;
- ``num_resumes`` is the number of syncs that hit the sample (its request was
  in the engine when the sync aborted) and left it budget to go on with;
- ``token_versions`` records each switch: constant within what the engine
  generated between two syncs, one version higher after each, and changing
  nowhere else.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import defaultdict
from typing import Any

import pytest
import torch

import loop
from actors.engines.config import EngineConfig
from actors.models import BUILTIN_MODEL_DIR, load_causal_lm
from actors.rollout import RolloutActor
from contracts.rollout import GroupRequest, SamplingParams
from policies.partial import absorb, next_request
from sync import WeightSender
from sync.sequence import sync_weights

VOCAB = 21  # tiny-qwen2
EOS = 2


class _Queue:
    """The TransferQueue's ``put`` end: keeps what the actor queues."""

    def __init__(self) -> None:
        self.samples: list[Any] = []

    async def put(self, samples: list[Any]) -> None:
        self.samples.extend(samples)


class _Task:
    """Every finished response scores 1: the test is about tokens, not rewards."""

    def reward(self, meta: dict[str, str], response_ids: list[int]) -> float:
        return 1.0


def _make_task() -> _Task:
    return _Task()


class _Brake:
    """Stops the engine's thread after a given number of its steps, from inside
    it: the point of an interrupt is exact, not whenever the test's loop gets
    the GIL back from the engine's thread."""

    def __init__(self, engine: Any) -> None:
        self._core, self._loop = engine._core, asyncio.get_running_loop()
        self._left: int | None = None
        self._stopped = asyncio.Event()
        step = self._core._step

        def braked_step() -> None:  # on the engine's thread
            step()
            if self._left is not None:
                self._left -= 1
                if self._left <= 0:
                    self._core.paused, self._left = True, None
                    self._loop.call_soon_threadsafe(self._stopped.set)

        self._core._step = braked_step

    async def after(self, steps: int, tasks: list[asyncio.Task]) -> None:
        """Return once the engine stopped after ``steps`` more steps (at once for 0),
        or nothing is left to generate."""
        if steps == 0:
            return
        self._stopped.clear()
        self._left = steps
        stopped = asyncio.ensure_future(self._stopped.wait())
        while not stopped.done() and not all(t.done() for t in tasks):
            pending = [t for t in tasks if not t.done()]
            await asyncio.wait([stopped, *pending], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        self._left = None


async def _scenario(seed: int) -> None:
    rng = random.Random(seed)
    max_response_tokens = rng.randint(6, 40)
    num_syncs = rng.randint(1, 5)
    stop = (EOS,) if seed % 2 else ()  # odd seeds may also stop early
    queue = _Queue()
    actor = RolloutActor(engine=EngineConfig(max_num_seqs=16, max_model_len=128, cuda_graphs=False),
                         model_path=str(BUILTIN_MODEL_DIR), seed=seed, make_task=_make_task,
                         sampling=SamplingParams(temperature=1.0, stop_token_ids=stop),
                         max_response_tokens=max_response_tokens, partial_rollout=True,
                         next_request=next_request, absorb=absorb, queue=queue, reward_timeout_s=10.0)
    await actor.setup()
    await actor.open_weight_link("inproc")
    model = load_causal_lm(BUILTIN_MODEL_DIR)  # the trainer's copy
    sender = WeightSender(mode="delta", dtype=torch.float32)
    hits: dict[str, list[tuple[str, int, int]]] = defaultdict(list)  # uid -> (request id, tokens, version)
    engine_prepare, engine_swap = actor.engine.prepare_swap, actor.engine.swap_weights

    def record(outs: list[Any], version: int) -> None:
        for out in outs:
            assert set(out.token_versions) <= {version}
            hits[out.request_id.split("/")[0]].append((out.request_id, len(out.token_ids), version))

    async def recording_prepare(in_flight: str = "abort") -> list[Any]:
        version = actor.engine.version
        outs = await engine_prepare(in_flight)
        record(outs, version)
        return outs

    async def recording_swap(update: Any, in_flight: str = "abort", asleep: bool = False) -> Any:
        version = actor.engine.version
        report = await engine_swap(update, in_flight, asleep)
        record(report.aborted, version)
        return report

    actor.engine.prepare_swap, actor.engine.swap_weights = recording_prepare, recording_swap
    try:
        prompts = {"short": [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 3))],
                   "long": [rng.randrange(4, VOCAB) for _ in range(rng.randint(40, 80))]}
        groups = [GroupRequest(group_id=name, prompt_ids=ids, n=4) for name, ids in prompts.items()]
        tasks = [asyncio.ensure_future(actor.generate_group(g)) for g in groups]
        brake = _Brake(actor.engine)
        while not (actor.engine.statistics()["num_running"] or actor.engine.statistics()["num_waiting"]):
            await asyncio.sleep(0.0005)  # submitted: the first sync may still come before any token
        for version in range(1, num_syncs + 1):
            # the point: the engine stopped there, as the sequence's own pause would stop it
            await brake.after(rng.randint(0, max_response_tokens // 2), tasks)
            await actor.pause()
            with torch.no_grad():  # a small real change: the engines' weights differ after every push
                p = model.model.norm.weight
                p[rng.randrange(p.numel())] += 1e-3
            await sync_weights([actor], sender, weights=model.state_dict(), version=version,
                               colocated=rng.random() < 0.5)
            assert actor.engine.version == version
        reports = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        await actor.close()

    samples = {s.uid: s for s in queue.samples}
    assert sum(r.num_queued for r in reports) == len(samples) == 8
    assert sum(r.num_resumed for r in reports) == sum(1 for s in samples.values() if s.num_resumes > 0)
    assert any(hits.values()), "no sync hit a generation: the test checks nothing"
    for uid, s in samples.items():
        versions = [int(v) for v in s.token_versions]
        n = len(s.response_ids)
        assert n <= max_response_tokens and len(versions) == len(s.rollout_logprobs) == n
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "length":
            assert n == max_response_tokens
        segments = hits.get(uid, [])
        # each hit aborted the request the sample had resumed with as often as it had resumed
        assert [rid for rid, _, _ in segments] == [f"{uid}/{i}" for i in range(len(segments))]
        spent = sum(k for _, k, _ in segments)
        assert spent <= n
        ended_by_a_sync = spent == max_response_tokens  # the last hit took its whole budget: no resume
        assert s.num_resumes == len(segments) - ended_by_a_sync, (uid, segments, n)
        # versions: one per segment, the engine's at the sync that ended it; one higher in the next
        expected: list[int] = []
        for _, k, v in segments:
            expected += [v] * k
        if not ended_by_a_sync:
            expected += [(segments[-1][2] + 1 if segments else 0)] * (n - spent)
        assert versions == expected, (uid, segments, versions)
        hit_versions = [v for _, _, v in segments]
        assert all(b == a + 1 for a, b in zip(hit_versions, hit_versions[1:])), (uid, segments)
        boundaries = set(itertools.accumulate(k for _, k, _ in segments))
        assert {i for i in range(1, n) if versions[i] != versions[i - 1]} <= boundaries


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(6))
def test_resumes_at_random_syncs_keep_the_budget_count_the_interrupts_and_record_each_switch(seed: int) -> None:
    loop.run(_scenario(seed))
