"""TrainerActor: owns one trainer backend; pulls its batches from the
TransferQueue, turns them into optimizer steps, and pushes weights to the
engines through the weight link.

    policy ──BatchRequest──► train_step ──get──► TransferQueue (whole groups, not too stale)
           ◄──StepReport──   advantages, loss, optimizer step ──ack (nack on failure)──►

Endpoints (all async; the work runs on the actor's worker thread):
    train_step(request)       take a batch, one optimizer step, ack -> StepReport (counts, metrics)
    weight_update()           encode the current weights (full or delta) and publish them:
                              returns the manifest and a small handle, never the payload
    broadcast_pending()/release_weights()   the link's sending side (``sync.link``)
    weights_refused()         a receiver refused a delta: next update is full
    observe(...)/revert_update()  cost feedback for sync.mode=auto; undo of a failed push
    save(dir) / load(dir)     checkpoint (safetensors + optimizer state)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from actors.runtime import Actor, quiet_transformers
from contracts.sample import Sample, batch_stats
from contracts.training import BatchRequest, StepReport

__all__ = ["TrainerActor"]


class TrainerActor(Actor):
    """One optimizer over the policy model, behind a backend (``actors.backends``).

    ``trainer``: the backend's config section; ``sync``: the weight-sync
    section; ``loss``: the loss object and ``advantages(rewards, groups)`` the
    advantage estimator (policy math, injected); ``queue``: the TransferQueue
    client batches come from."""

    def __init__(self, *, trainer: Any, sync: Any, model_path: str, seed: int, loss: Any,
                 advantages: Callable[..., Any], queue: Any, engine_dtype: str,
                 torch_threads: int | None = None) -> None:
        self.trainer_cfg, self.sync_cfg, self.model_path, self.seed = trainer, sync, model_path, seed
        self.loss, self.advantages, self.queue, self.engine_dtype = loss, advantages, queue, engine_dtype
        self.torch_threads = torch_threads
        self.backend: Any = None
        self.sender: Any = None
        self._link: Any = None  # sync.link.TrainerLink once the transport is known

    async def setup(self) -> None:
        await self.blocking(self._setup)

    def _setup(self) -> None:
        import torch

        from actors.backends import make_backend
        from sync import WeightSender

        quiet_transformers()
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        self.backend = make_backend(self.trainer_cfg, self.model_path, seed=self.seed, loss=self.loss)
        self.backend.setup()
        self.sender = WeightSender.from_config(self.sync_cfg, dtype=getattr(torch, self.engine_dtype))

    async def get_version(self) -> int:
        return self.backend.version

    async def train_step(self, request: BatchRequest) -> StepReport:
        """Take the batch ``request`` describes from the queue, train on it, ack it
        (nack if the step fails, so its samples are handed out again)."""
        t0 = time.perf_counter()
        batch = await self.queue.get(
            consumer=request.consumer, batch_size=request.batch_size, sampler="grpo_group",
            group_size=request.group_size, current_version=request.current_version,
            max_staleness=request.max_staleness)
        t1 = time.perf_counter()
        try:
            samples: list[Sample] = batch.samples
            metrics = await self.blocking(self._train_step, samples)
        except BaseException:
            await self.queue.nack(batch.batch_id)
            raise
        await self.queue.ack(batch.batch_id)
        stats = batch_stats(samples, request.current_version)
        return StepReport(version=self.backend.version, num_samples=len(samples),
                          num_tokens=sum(len(s.response_ids) for s in samples),
                          wait_s=t1 - t0, train_s=time.perf_counter() - t1, dropped=dict(batch.dropped),
                          metrics={**stats, **{f"train/{k}": v for k, v in metrics.items()}})

    def _train_step(self, samples: list[Sample]) -> dict[str, float]:
        import torch

        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        index: dict[str, int] = {}
        groups = torch.tensor([index.setdefault(s.group_id, len(index)) for s in samples])
        advantages = self.advantages(rewards, groups)
        metrics = self.backend.train_step(samples, advantages.tolist())
        metrics["reward_mean"] = float(rewards.mean())
        return metrics

    # -- the weight link ------------------------------------------------------

    async def placement(self) -> Any:
        from contracts.placement import placement

        return placement(str(self.backend.device))

    async def open_weight_link(self, kind: str) -> str | None:
        """Publish updates over transport ``kind``; for ``dist``, returns the
        rendezvous address on this node that every member joins."""
        from sync.link import TrainerLink

        self._link = TrainerLink(kind, self.backend.device)
        return TrainerLink.rendezvous() if kind == "dist" else None

    async def join_weight_group(self, init_method: str, world_size: int, backend: str) -> None:
        """Join the broadcast group as rank 0 (with every rollout actor at once)."""
        await self.blocking(self._link.join, init_method, world_size, backend)

    async def weight_update(self) -> Any:
        """The update that brings the engines to this trainer's current version, published."""
        return await self.blocking(self._weight_update)

    def _weight_update(self) -> Any:
        return self._link.publish(self.sender.encode(self.backend.named_weights(), self.backend.version))

    async def broadcast_pending(self) -> int:
        """Broadcast the last published update to the group; returns its bytes."""
        return await self.blocking(self._link.broadcast_pending)

    async def release_weights(self) -> None:
        """Let go of the payloads published since the last call (every engine has applied them)."""
        if self._link is not None:
            self._link.release()

    async def weights_refused(self) -> None:
        self.sender.force_full()

    async def observe(self, kind: str, *, encode_ms: float, transfer_ms: float, apply_ms: float) -> None:
        """Measured cost of the last sync (``sync.mode=auto`` picks full or delta from it)."""
        self.sender.observe(kind, encode_ms=encode_ms, transfer_ms=transfer_ms, apply_ms=apply_ms)

    async def revert_update(self) -> Any:
        """The update that takes engines back to the previous version after a failed push."""
        return self._link.publish(await self.blocking(self.sender.revert_update))

    async def weights_digest(self, dtype: str) -> dict[str, str]:
        """sha256 of every weight cast to the engine's ``dtype``, by HF name."""
        from sync.link import digest_named

        return await self.blocking(lambda: digest_named(self.backend.named_weights(dtype)))

    async def save(self, path: str) -> None:
        await self.blocking(self.backend.save, path)

    async def load(self, path: str) -> None:
        await self.blocking(self.backend.load, path)
