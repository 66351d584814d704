"""RolloutActor: owns one rollout engine; turns prompt groups into scored
samples and puts them into the TransferQueue itself.

    policy ──GroupRequest──► generate_group ──► engine (resumed across syncs) ──► reward
           ◄──GroupReport──  (counts)            └─ whole, scored group ──► TransferQueue.put

Endpoints (all async):
    generate_group(group)      n samples of one prompt: generated, resumed across weight
                               syncs, scored and queued; returns a GroupReport (counts only)
    evaluate(prompts)          one greedy response per held-out prompt, scored (rewards only)
    stage_weights/swap_weights the weight swap, as the sync sequence drives it: the
                               payload checked while generating, then swapped in by the engine
                               (``prepare_swap`` first when the push frees the KV cache)
    pause/abort/sleep/wake_up/update_weights/reset_prefix_cache/resume/get_version
                               the engine's verbs, for recovery and tests
    placement/join_weight_group   where it runs; the broadcast group (``sync.link``)
    weight_link()              how it joined that group (the policy re-forms it without a dead actor)

An interrupted generation (``abort`` during a weight sync) keeps its partial
tokens here, waits for ``resume`` and continues from prompt + partial tokens
with what is left of its budget (the injected ``next_request`` / ``absorb``
rule); with ``partial_rollout=False`` it ends as ``abort`` and its group is
dropped, counted. A group with a failed member is dropped whole (the trainer
takes only whole groups), counted by reason in the report: ``reward_error``
(the reward raised or returned no finite number), ``reward_timeout`` (it took longer
than ``reward_timeout_s``), ``aborted``, and ``group_incomplete`` for the
failed member's group-mates.

The actor counts for itself (``RolloutCounts``, in every report and in
``statistics``): the samples of every group it was asked for as the request
arrives, those of the groups it finished, and of those the ones the queue took
and the ones it dropped, by reason. The policy checks ``received == generated +
working`` and ``generated == queued + dropped`` per actor, each report against
the group it asked for, and the actors' ``queued`` against the queue's own count
of samples put (``policies/accounting.py``).
"""

from __future__ import annotations

import asyncio
import math
import sysconfig
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import msgspec
import torch

from actors import gc_clock
from actors.engines import EngineConfig, RolloutEngine, make_engine
from actors.reward_pool import RewardPool
from actors.runtime import Actor, quiet_transformers
from contracts.placement import Placement, placement as placement_of
from contracts.rollout import (GenerateOutput, GroupReport, GroupRequest, InFlight, RolloutCounts, SamplingParams,
                               SwapReport)
from contracts.sample import Sample, pack_tokens
from contracts.weights import WeightHandle, WeightUpdate
from sync.link import EngineLink, digest_named
from transfer_queue.client import TransferQueue

__all__ = ["RolloutActor"]

_DROP_REASON = {"error": "reward_error", "abort": "aborted"}
_REWARD_TIMEOUT = "reward: TimeoutError"  # the start of a timed-out sample's ``error``


def where(err: BaseException) -> str:
    """`` (file:line)`` of the innermost frame of ``err``'s traceback outside the
    standard library and installed packages: where the user's reward raised; ""
    for an error that names its place itself (a ``location``: where a function
    that returned no score is defined, ``policies.rewards.RewardValueError``)."""
    if getattr(err, "location", None):
        return ""
    outside = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_LIBRARY_DIRS)]
    return f" ({outside[-1].filename}:{outside[-1].lineno})" if outside else ""


_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def _drop_reason(sample: Sample) -> str:
    """Why ``sample`` keeps its group out of the queue (its group-mates: ``group_incomplete``)."""
    if sample.finish_reason == "error" and (sample.error or "").startswith(_REWARD_TIMEOUT):
        return "reward_timeout"
    return _DROP_REASON.get(sample.finish_reason or "", "group_incomplete")


class RolloutActor(Actor):
    """Generates, scores and queues samples with one engine (built-in torch, vLLM or SGLang).

    ``engine``: the engine's config section; ``make_task()`` builds the task
    (its reward); ``next_request(sample, budget, sampling)`` and
    ``absorb(sample, output, budget)`` are the resume-budget rule; ``queue``:
    the TransferQueue client finished groups go to."""

    # What setup needs, imported while the process waits for its actor (ProcessRuntime.prestart): the
    # built-in engine, and the task with its tokenizer, light where the model directory allows
    # (policies/tokenizer.py: no transformers). vLLM and SGLang import theirs when they start.
    preload = ("actors.engines.torch_engine", "policies.tasks", "policies.tokenizer")

    def __init__(self, *, engine: EngineConfig, model_path: str, seed: int, make_task: Callable[[], object],
                 sampling: SamplingParams, max_response_tokens: int, partial_rollout: bool,
                 next_request: Callable[..., object], absorb: Callable[..., bool], queue: TransferQueue,
                 reward_timeout_s: float = 30.0, reward_workers: int = 8, torch_threads: int | None = None,
                 mtp_layers: int = 0) -> None:
        self.engine_cfg, self.model_path, self.seed = engine, model_path, seed
        self.mtp_layers = mtp_layers  # model.mtp_layers: the MTP modules the engine holds (and drafts with)
        self.make_task, self.sampling, self.max_response_tokens = make_task, sampling, max_response_tokens
        self.partial_rollout, self.reward_timeout_s = partial_rollout, reward_timeout_s
        self._next_request, self._absorb, self.queue = next_request, absorb, queue
        self.torch_threads = torch_threads
        self.engine: RolloutEngine | None = None
        self.task: Any = None  # the policy's task (policies.tasks): its reward(meta, response_ids)
        self._running: asyncio.Event | None = None
        self._link: EngineLink | None = None  # once the transport is known
        self._link_group: tuple[str, int] | None = None  # (backend, sources) of the broadcast group joined
        self.num_reward_errors = 0  # timeouts included
        self.rewards = RewardPool(reward_workers)  # threads start with the first reward call
        self.num_scoring = 0  # samples submitted to the pool and not scored yet
        self.num_reward_calls = 0  # ended (returned, raised or timed out)
        self.reward_call_s = 0.0  # summed seconds of the reward calls themselves
        self.reward_busy_s = 0.0  # wall seconds while any sample was being scored (queued or running)
        self._busy_since = 0.0  # perf_counter when num_scoring last rose from 0
        self.num_reward_timeouts = 0
        self.num_aborted = 0  # generations interrupted by a sync (kept here and resumed, or dropped)
        self.num_received = 0  # samples of every group asked for, counted as the request arrives
        self.num_working = 0  # ... of those, the ones of groups not finished yet
        self.num_generated = 0  # samples of every group finished generating: then queued, or dropped here
        self.num_queued = 0
        self.dropped: Counter[str] = Counter()

    async def setup(self) -> None:
        t0 = time.perf_counter()
        gc_clock.install()  # statistics() carries the collector's pauses: each stops the engine's thread too
        if self.engine_cfg.type != "torch":  # the built-in engine and a light tokenizer never import transformers
            quiet_transformers()
        self.note_startup("import_s", t0)
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        self._running = asyncio.Event()
        self._running.set()
        t0 = time.perf_counter()
        self.task = self.make_task()
        self.note_startup("task_s", t0)
        t0 = time.perf_counter()
        self.engine = make_engine(self.engine_cfg, self.model_path, seed=self.seed, mtp_layers=self.mtp_layers)
        await self.engine.setup()
        self.note_startup("engine_s", t0)  # weights loaded, KV cache allocated (CUDA graphs come lazily)

    # -- generation ---------------------------------------------------------

    async def generate_group(self, group: GroupRequest) -> GroupReport:
        """Generate, resume and score ``group.n`` samples; queue them if all
        finished, else drop them (counted). Returns counts, never samples.

        Counted at two points (``RolloutCounts``): ``received`` as the request
        arrives, before any work; ``generated`` (and ``queued`` or ``dropped``) once
        the group is done. A sample lost in between leaves ``received`` ahead of
        ``generated + working`` for good, and the report short of ``group.n``."""
        self.num_received += group.n
        self.num_working += group.n
        samples = await self._generate(group)
        report = GroupReport(group_id=group.group_id, num_samples=len(samples), num_queued=0,
                             num_resumed=sum(1 for s in samples if s.num_resumes > 0))
        whole = len(samples) == group.n and all(
            s.finish_reason in ("stop", "length") and s.reward is not None for s in samples)
        if whole:
            await self._put(samples)
        # counted at once, after the put returns (the queue has them): no await between the
        # counts, so generated == queued + dropped whenever anyone reads them
        self.num_working -= group.n
        self.num_generated += len(samples)
        if whole:
            report.num_queued = len(samples)
            report.min_version = min(s.min_version for s in samples)  # the queue's staleness test reads the same
            self.num_queued += len(samples)
        else:
            reasons = Counter(_drop_reason(s) for s in samples)
            report.dropped = dict(reasons)
            self.dropped.update(reasons)
        report.counts = self._counts()
        failed = [s.error.removeprefix("reward: ") for s in samples if s.finish_reason == "error" and s.error]
        report.num_scored = sum(1 for s in samples if s.finish_reason != "abort")
        report.num_reward_errors = len(failed)
        report.reward_error = failed[0] if failed else None
        return report

    async def _generate(self, group: GroupRequest) -> list[Sample]:
        """``group.n`` samples of ``group``, each generated (resumed across weight
        syncs) and scored, or ended by an abort or a failed reward."""
        now = time.time()
        samples = [
            Sample(uid=f"{group.group_id}-{i}", group_id=group.group_id,
                   prompt_ids=list(group.prompt_ids), meta=dict(group.meta), created_s=now)
            for i in range(group.n)
        ]
        await asyncio.gather(*(self._generate_one(s) for s in samples))
        return samples

    async def _put(self, samples: list[Sample]) -> None:
        """A whole, scored group into the TransferQueue (token lists become arrays)."""
        await self.queue.put([pack_tokens(s) for s in samples])

    def _counts(self) -> RolloutCounts:
        """This actor's totals (see the module docstring)."""
        return RolloutCounts(received=self.num_received, working=self.num_working, generated=self.num_generated,
                             queued=self.num_queued, dropped=dict(self.dropped))

    async def evaluate(self, prompts: list[GroupRequest]) -> list[tuple[float | None, int]]:
        """One greedy response to each prompt, scored: (reward, or None when the
        reward failed; response tokens) per prompt. Nothing is queued."""
        greedy = msgspec.structs.replace(self.sampling, temperature=0.0, seed=None)
        samples = [Sample(uid=f"eval-{p.group_id}", group_id=p.group_id, prompt_ids=list(p.prompt_ids),
                          meta=dict(p.meta)) for p in prompts]
        await asyncio.gather(*(self._generate_one(s, greedy) for s in samples))
        return [(s.reward if s.finish_reason in ("stop", "length") else None, len(s.response_ids))
                for s in samples]

    async def _generate_one(self, sample: Sample, sampling: SamplingParams | None = None) -> None:
        assert self._running is not None, "setup() was not awaited"
        while True:
            await self._running.wait()  # a sync in progress: resume on the new weights
            out: GenerateOutput = await self.engine.generate(
                self._next_request(sample, self.max_response_tokens, sampling or self.sampling))
            if self._absorb(sample, out, self.max_response_tokens):
                break
            if not self.partial_rollout:
                sample.finish_reason = "abort"
                sample.finished_s = time.time()
                return
            sample.num_resumes += 1
        sample.finished_s = time.time()
        await self._score(sample)

    async def _score(self, sample: Sample) -> None:
        """Reward (any finite float); a reward function that raises (or hangs) marks
        only this sample as ``error`` — counted, never fatal to the run.

        Rewards run on the actor's reward pool, ``reward_workers`` calls at
        once (``actors/reward_pool.py``), each timed from its own start there:
        samples queued behind slow ones are not charged for them. A reward
        that hangs (not cut short by its own guard, ``TimedReward``) times out
        after ``reward_timeout_s`` once its turn came (the wait for a free
        worker allowed for); its thread is abandoned. ``reward_call_s`` /
        ``reward_busy_s`` is how many calls ran at once on average."""
        if self.num_scoring == 0:
            self._busy_since = time.perf_counter()
        self.num_scoring += 1
        ahead = (self.num_scoring - 1) // self.rewards.num_workers  # rounds of calls before this one's turn
        call = self.rewards.submit(self.task.reward, sample.meta, list(sample.response_ids))
        outcome: tuple[object, float] | None = None
        try:
            outcome = await asyncio.wait_for(asyncio.wrap_future(call), self.reward_timeout_s * (ahead + 1) + 1.0)
        except TimeoutError:
            call.cancel()  # still queued: never run
        finally:
            self.num_scoring -= 1
            if self.num_scoring == 0:
                self.reward_busy_s += time.perf_counter() - self._busy_since
        self.num_reward_calls += 1
        self.reward_call_s += outcome[1] if outcome is not None else self.reward_timeout_s
        self._take_reward(sample, outcome)

    def _take_reward(self, sample: Sample, outcome: tuple[object, float] | None) -> None:
        """Set ``sample``'s reward from what its reward call returned, or mark it ``error``."""
        try:
            if outcome is None:
                raise TimeoutError(f"no reward within reward_timeout_s={self.reward_timeout_s:g} s")
            value, seconds = outcome
            if isinstance(value, BaseException):
                raise value
            if seconds > self.reward_timeout_s:
                raise TimeoutError(f"the reward took {seconds:.3g} s, over "
                                   f"reward_timeout_s={self.reward_timeout_s:g} s")
            reward = float(value)
            if not math.isfinite(reward):  # any finite float is a reward: GRPO compares a group's own scores
                raise ValueError(f"reward {reward} is not a finite number")
            sample.reward = reward
        except Exception as err:  # isolated on purpose: one bad reward, one dropped sample
            self.num_reward_errors += 1
            self.num_reward_timeouts += isinstance(err, TimeoutError)  # this loop's and TimedReward's
            sample.finish_reason, sample.error = "error", f"reward: {type(err).__name__}: {err}{where(err)}"

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

    async def abort(self, request_ids: list[str] | None = None) -> int:
        """Interrupt in-flight generations; their partial outputs stay here (each
        waiting generation absorbs its own). Returns how many were interrupted."""
        num = len(await self.engine.abort(request_ids))
        self.num_aborted += num
        return num

    async def sleep(self, level: int = 1) -> None:
        await self.engine.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine.wake_up(tags)

    async def update_weights(self, handle: WeightHandle) -> int:
        """Apply the update behind ``handle`` (fetched through the weight link)."""
        return await self.engine.update_weights(await self._receive(handle))

    async def prepare_swap(self, in_flight: InFlight = "abort") -> int:
        """The engine's ``prepare_swap`` (pause, abort in ``abort`` mode, ``sleep(1)``);
        the aborted generations wait here for :meth:`swap_weights`. Returns their number."""
        self._running.clear()
        try:
            num = len(await self.engine.prepare_swap(in_flight))
        except BaseException:
            self._running.set()
            raise
        self.num_aborted += num
        return num

    async def swap_weights(self, handle: WeightHandle, in_flight: InFlight = "abort", asleep: bool = False) -> SwapReport:
        """Receive the update behind ``handle`` (over a broadcast link: while the
        engine still generates) and let the engine swap it in (its
        ``swap_weights``). Aborted generations (``abort`` mode) keep their partial
        tokens here and go on from them on the new weights, all submitted at once.
        Returns the engine's report, with the number aborted."""
        update = await self._receive(handle)
        if in_flight == "abort":
            self._running.clear()  # the aborted wait, to resubmit together on the new weights
        try:
            report = await self.engine.swap_weights(update, in_flight, asleep)
        finally:
            self._running.set()
        self.num_aborted += report.num_aborted
        report.aborted = report.num_aborted
        return report

    async def _receive(self, handle: WeightHandle) -> WeightUpdate:
        if self._link is None:
            raise RuntimeError("a weight update before open_weight_link()")
        if self._link.collective:  # takes part in the group's broadcast: blocking
            return await self.blocking(self._link.receive, handle)
        return cast(WeightUpdate, handle)  # published ahead: the update itself, its buckets references

    async def stage_weights(self, handle: WeightHandle) -> bool:
        """Check the update behind ``handle`` ahead of :meth:`update_weights`
        while generating (the engine's ``stage_weights``); False over a collective link."""
        if self._link is None:
            raise RuntimeError("stage_weights() before open_weight_link()")
        if self._link.collective:
            return False
        return await self.engine.stage_weights(cast(WeightUpdate, handle))

    async def placement(self) -> Placement:
        return placement_of(str(self.engine_cfg.device))

    async def open_weight_link(self, kind: str) -> None:
        self._link, self._link_group = EngineLink(kind), None

    async def join_weight_group(self, init_method: str, rank: int, world_size: int, backend: str,
                                sources: int = 1) -> None:
        """Join the weight-sync broadcast group (with the ``sources`` trainer
        workers, ranks below this one's, and every other rollout actor)."""
        await self.blocking(self._link.join, init_method, rank, world_size, backend, sources)
        self._link_group = (backend, sources)

    async def weight_link(self) -> tuple[str, str | None, int] | None:
        """How weights reach this actor: (transport kind, broadcast backend, trainer
        workers sending) as ``open_weight_link`` / ``join_weight_group`` set it (backend
        None and 0 sources outside a broadcast group); None before a link is open."""
        if self._link is None:
            return None
        backend, sources = self._link_group or (None, 0)
        return self._link.kind, backend, sources

    async def weights_digest(self) -> dict[str, str]:
        """sha256 of every weight the engine holds, by HF name (for bit-exactness checks)."""
        return await self.blocking(digest_named, self.engine.named_weights())

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def get_version(self) -> int:
        return self.engine.version

    async def statistics(self) -> dict[str, object]:
        """The engine's counters and step timings (when it keeps them), and this actor's.
        ``loop_cpu_s``: CPU seconds of the thread that runs this actor's event loop (its
        process's own under ``process`` and Ray; the driver's loop, shared, under ``local``);
        ``process_cpu_s``: of its whole process, every thread."""
        engine = {} if self.engine is None else self.engine.statistics()
        return {**engine, "loop_cpu_s": time.thread_time(), "process_cpu_s": time.process_time(), **gc_clock.snapshot(),
                "num_reward_errors": self.num_reward_errors,
                "num_reward_timeouts": self.num_reward_timeouts, "num_aborted": self.num_aborted,
                "num_scoring": self.num_scoring, "num_reward_calls": self.num_reward_calls,
                "reward_call_s": self.reward_call_s,
                "reward_busy_s": self.reward_busy_s
                + (time.perf_counter() - self._busy_since if self.num_scoring else 0.0),
                "num_received": self.num_received, "num_working": self.num_working,
                "num_generated": self.num_generated, "num_queued": self.num_queued, "dropped": dict(self.dropped),
                "paused": self._running is not None and not self._running.is_set()}  # by a push: pause() to resume()

    async def close(self) -> None:
        self.rewards.close()  # a call blocked in user code is abandoned, never waited for
        if self.engine is not None:
            await self.engine.close()
        await super().close()
