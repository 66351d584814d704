"""RolloutActor: owns one rollout engine; turns prompt groups into scored samples.

Endpoints (all async):
    generate_group(group)      n samples of one prompt, generated, resumed across
                               weight syncs, and scored (token fields as numpy arrays)
    pause/abort/sleep/wake_up/update_weights/reset_prefix_cache/resume/get_version
                               the engine surface the weight-sync sequence drives

An interrupted generation (``abort`` during a weight sync) waits for
``resume`` and continues from prompt + partial tokens with what is left of
its budget (``policies.partial``); with ``partial_rollout=False`` it ends as
``abort`` and the policy drops it, counted.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from actors.engines.base import GenerateOutput, SamplingParams
from actors.runtime import Actor, quiet_transformers
from policies.partial import absorb, next_request
from transfer_queue.sample import Sample, pack_tokens

__all__ = ["GroupRequest", "RolloutActor"]


class GroupRequest(msgspec.Struct, kw_only=True):
    """One prompt to sample ``n`` times (one GRPO group)."""

    group_id: str
    prompt_ids: list[int]
    n: int
    meta: dict[str, str] = msgspec.field(default_factory=dict)


class RolloutActor(Actor):
    """Generates and scores samples with one engine (built-in torch, vLLM or SGLang)."""

    def __init__(self, *, engine_type: str, model_path: str, engine_kwargs: dict[str, Any],
                 task_type: str, task_kwargs: dict[str, Any], sampling: SamplingParams,
                 max_response_tokens: int, partial_rollout: bool, reward_timeout_s: float = 30.0,
                 torch_threads: int | None = None) -> None:
        self.engine_type, self.model_path, self.engine_kwargs = engine_type, model_path, engine_kwargs
        self.task_type, self.task_kwargs = task_type, task_kwargs
        self.sampling, self.max_response_tokens = sampling, max_response_tokens
        self.partial_rollout, self.reward_timeout_s = partial_rollout, reward_timeout_s
        self.torch_threads = torch_threads
        self.engine: Any = None
        self.task: Any = None
        self._running: asyncio.Event | None = None
        self._group: Any = None  # broadcast transport when weights come over torch.distributed
        self.num_reward_errors = 0

    async def setup(self) -> None:
        import torch  # imported here so the first call is not slow (Ray actors)

        from actors.engines import make_engine
        from policies.tasks import make_task

        quiet_transformers()
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        self._running = asyncio.Event()
        self._running.set()
        self.task = make_task(self.task_type, **self.task_kwargs)
        self.engine = make_engine(self.engine_type, self.model_path, **self.engine_kwargs)
        await self.engine.setup()

    # -- generation ---------------------------------------------------------

    async def generate_group(self, group: GroupRequest) -> list[Sample]:
        """Generate, resume and score ``group.n`` samples; returns all of them."""
        now = time.time()
        samples = [
            Sample(uid=f"{group.group_id}-{i}", group_id=group.group_id,
                   prompt_ids=list(group.prompt_ids), meta=dict(group.meta), created_s=now)
            for i in range(group.n)
        ]
        await asyncio.gather(*(self._generate_one(s) for s in samples))
        return [pack_tokens(s) for s in samples]  # finished: token lists become arrays

    async def _generate_one(self, sample: Sample) -> None:
        assert self._running is not None, "setup() was not awaited"
        while True:
            await self._running.wait()  # a sync in progress: resume on the new weights
            out: GenerateOutput = await self.engine.generate(
                next_request(sample, self.max_response_tokens, self.sampling))
            if absorb(sample, out, self.max_response_tokens):
                break
            if not self.partial_rollout:
                sample.finish_reason = "abort"
                sample.finished_s = time.time()
                return
            sample.num_resumes += 1
        sample.finished_s = time.time()
        await self._score(sample)

    async def _score(self, sample: Sample) -> None:
        """Reward in [0, 1]; a reward function that raises (or hangs) marks
        only this sample as ``error`` — counted, never fatal to the run."""
        try:
            reward = await asyncio.wait_for(
                self.blocking(self.task.reward, sample.meta, list(sample.response_ids)),
                self.reward_timeout_s)
            reward = float(reward)
            if not 0.0 <= reward <= 1.0:
                raise ValueError(f"reward {reward} outside [0, 1]")
            sample.reward = reward
        except Exception as err:  # isolated on purpose: one bad reward, one dropped sample
            self.num_reward_errors += 1
            sample.finish_reason, sample.error = "error", f"reward: {type(err).__name__}: {err}"

    # -- engine surface for the weight-sync sequence ------------------------

    async def pause(self) -> None:
        assert self._running is not None
        self._running.clear()
        await self.engine.pause()

    async def resume(self) -> None:
        """Interrupted generations resubmit first, while the engine is still
        paused, so it admits them together (one batched prefill) instead of
        one by one between decode steps. Best effort: two loop turns let the
        waiters wake and submit; a late one is still served, just alone."""
        assert self._running is not None
        self._running.set()
        for _ in range(2):
            await asyncio.sleep(0)
        await self.engine.resume()

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        return await self.engine.abort(request_ids)

    async def sleep(self, level: int = 1) -> None:
        await self.engine.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine.wake_up(tags)

    async def update_weights(self, update: Any) -> int:
        from actors.weight_group import DistPush

        if isinstance(update, DistPush):  # the payload arrives by broadcast from the trainer
            if self._group is None:
                raise RuntimeError("a broadcast push reached an actor outside the weight group")
            update = await self.blocking(self._group.receive)
        return await self.engine.update_weights(update)

    async def weights_digest(self) -> dict[str, str]:
        """sha256 of every weight the engine holds, by HF name (for bit-exactness checks)."""
        from actors.weight_group import digest_named

        return await self.blocking(digest_named, self.engine.named_weights())

    async def join_weight_group(self, init_method: str, rank: int, world_size: int, backend: str) -> None:
        """Join the weight-sync process group (with the trainer and every other rollout actor)."""
        from actors.weight_group import join_group

        self._group = await self.blocking(join_group, init_method, rank, world_size, backend)

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def get_version(self) -> int:
        return self.engine.version

    async def statistics(self) -> dict[str, float]:
        """The engine's counters and step timings (when it keeps them)."""
        stats = getattr(self.engine, "statistics", None)
        return {**(stats() if stats else {}), "num_reward_errors": self.num_reward_errors}

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()
        await super().close()
