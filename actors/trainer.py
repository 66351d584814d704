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
    revert_update()           undo of a failed push
    save(dir) / load(dir)     checkpoint (safetensors + optimizer state)
    save_state(dir) / load_state(dir)   the same plus this worker's torch RNG (a run checkpoint)
"""

from __future__ import annotations

import datetime
import pathlib
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from actors.backends import Loss, TrainerBackend, TrainerConfig, make_backend
from actors.backends.flops import FlopsModel, peak_flops
from actors.runtime import Actor, quiet_transformers
from contracts.placement import Placement, placement as placement_of
from contracts.sample import Sample, batch_stats
from contracts.training import BatchRequest, StepReport
from contracts.weights import ShardSpec, WeightUpdate
from sync import SyncConfig, WeightSender
from sync.link import TrainerLink, digest_named
from transfer_queue.batch import Batch
from transfer_queue.client import TransferQueue
from transfer_queue.errors import StorageUnitLost

__all__ = ["TrainerActor"]


class TrainerActor(Actor):
    """One optimizer over the policy model, behind a backend (``actors.backends``).

    ``trainer``: the backend's config section; ``sync``: the weight-sync
    section; ``loss``: the loss object and ``advantages(rewards, groups)`` the
    advantage estimator (policy math, injected); ``queue``: the TransferQueue
    client batches come from; ``mtp_layers``: ``model.mtp_layers``, the MTP modules the backend trains."""

    preload = ("actors.backends.torch_backend", "transformers.modeling_utils")  # ProcessRuntime.prestart

    def __init__(self, *, trainer: TrainerConfig, sync: SyncConfig, model_path: str, seed: int, loss: Loss,
                 advantages: Callable[..., torch.Tensor], queue: TransferQueue, engine_dtype: str,
                 torch_threads: int | None = None, rank: int = 0, world_size: int = 1,
                 group_init: str | None = None, mtp_layers: int = 0) -> None:
        self.trainer_cfg, self.sync_cfg, self.model_path, self.seed = trainer, sync, model_path, seed
        self.loss, self.advantages, self.queue, self.engine_dtype = loss, advantages, queue, engine_dtype
        self.torch_threads, self.mtp_layers = torch_threads, mtp_layers
        # data parallel (trainer.num_workers > 1): this worker's rank in the trainers' group
        self.rank, self.world_size, self.group_init = rank, world_size, group_init
        self.backend: TrainerBackend | None = None
        self.sender: WeightSender | None = None
        self._link: TrainerLink | None = None  # once the transport is known

    async def setup(self) -> None:
        await self.blocking(self._setup)

    def _setup(self) -> None:
        t0 = time.perf_counter()
        quiet_transformers()
        self.note_startup("import_s", t0)
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        if self.world_size > 1:  # the trainers' own group: the backend shards over it (FSDP2)
            device = str(self.trainer_cfg.device)
            if device == "cuda" and torch.cuda.device_count() > 1:  # one GPU a worker (Ray shows each its own)
                device = f"cuda:{self.rank % torch.cuda.device_count()}"
                self.trainer_cfg = msgspec.structs.replace(self.trainer_cfg, device=device)
            if device.startswith("cuda"):
                torch.cuda.set_device(torch.device(device))
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=self.group_init,
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(minutes=10))
        t0 = time.perf_counter()
        self.backend = make_backend(self.trainer_cfg, self.model_path, seed=self.seed, loss=self.loss,
                                    mtp_layers=self.mtp_layers)
        self.backend.setup()
        self.note_startup("model_s", t0)  # model loaded to its device, optimizer built
        if self.world_size > 1 and self.backend.shard_specs() is None:
            raise RuntimeError(f"trainer.backend={self.trainer_cfg.backend!r} does not shard over "
                               f"{self.world_size} trainer workers (trainer.num_workers)")
        self.flops = FlopsModel.from_model_dir(self.model_path, self.mtp_layers)
        peak = self.trainer_cfg.peak_tflops
        self.peak_flops = peak * 1e12 if peak else peak_flops(str(self.backend.device), self.trainer_cfg.dtype)

    async def get_version(self) -> int:
        return self.backend.version

    async def train_step(self, request: BatchRequest) -> StepReport:
        """Take the batch ``request`` describes from the queue, train on it, ack it
        (nack if the step fails, so its samples are handed out again)."""
        t0 = time.perf_counter()
        batch = await self._get_batch(request)
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
                          metrics={**stats, **{f"train/{k}": v for k, v in metrics.items()}},
                          examples=_spread(samples, request.num_examples))

    async def _get_batch(self, request: BatchRequest) -> Batch:
        """The batch ``request`` describes. One whose rows a lost storage unit held
        (its node died) went back to the queue, which dropped those samples counted
        (``storage_lost``): another batch is taken, as long as a unit is left."""
        while True:
            try:
                return await self.queue.get(
                    consumer=request.consumer, batch_size=request.batch_size, sampler="grpo_group",
                    group_size=request.group_size, current_version=request.current_version,
                    max_staleness=request.max_staleness, group_ids=request.group_ids)
            except StorageUnitLost as err:
                if err.unit < 0:  # every unit is gone
                    raise

    def _train_step(self, samples: list[Sample]) -> dict[str, float]:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        index: dict[str, int] = {}
        groups = torch.tensor([index.setdefault(s.group_id, len(index)) for s in samples])
        advantages = self.advantages(rewards, groups)
        t0 = time.perf_counter()
        metrics = self.backend.train_step(samples, advantages.tolist())  # its float metrics wait for the device
        achieved = self.flops.train_flops([len(s.prompt_ids) + len(s.response_ids) for s in samples],
                                          [len(s.response_ids) for s in samples]) / (
            time.perf_counter() - t0)
        metrics["tflops"] = achieved / 1e12
        if self.peak_flops:
            metrics["mfu"] = achieved / self.peak_flops
        metrics["reward_mean"] = float(rewards.mean())
        return metrics

    # -- the weight link ------------------------------------------------------

    async def placement(self) -> Placement:
        return placement_of(str(self.backend.device))

    async def open_weight_link(self, kind: str) -> str | None:
        """Publish updates over transport ``kind``; for ``broadcast``, returns the
        rendezvous address on this node that every member joins."""
        self._link = TrainerLink(kind, self.backend.device)
        if self.sender is None:  # a group formed again keeps sending against the copy of the last version
            # sync.mode auto becomes full or delta by the transport (sync.auto.mode_for)
            self.sender = WeightSender.from_config(self.sync_cfg, self.engine_dtype, transport=kind)
        return TrainerLink.rendezvous() if self._link.collective else None

    async def join_weight_group(self, init_method: str, world_size: int, backend: str) -> None:
        """Join the broadcast group as rank ``self.rank`` (every trainer worker
        sends its shards in rank order; with every rollout actor at once)."""
        await self.blocking(self._link.join, init_method, world_size, backend, self.rank, self.world_size)

    async def weight_update(self) -> WeightUpdate | None:
        """The update that brings the engines to this trainer's current version, published."""
        return await self.blocking(self._weight_update)

    def _weight_update(self) -> WeightUpdate | None:
        t0 = time.perf_counter()
        weights, specs = self.backend.named_weights(), self.backend.shard_specs()
        if specs is not None:  # this worker's shards: the engines merge every worker's update
            weights = [(name, t, specs[name]) for name, t in weights.items()]
        update = self._link.publish(self.sender.encode(weights, self.backend.version))
        if update is not None:
            update.manifest.source_ms = (time.perf_counter() - t0) * 1e3
        return update

    async def broadcast_pending(self) -> int:
        """Broadcast the last published update to the group; returns its bytes."""
        return await self.blocking(self._link.broadcast_pending)

    async def release_weights(self) -> None:
        """Let go of the payloads published since the last call (every engine has applied them)."""
        if self._link is not None:
            self._link.release()

    async def weights_refused(self) -> None:
        self.sender.force_full()

    async def revert_update(self) -> WeightUpdate | None:
        """The update that takes engines back to the previous version after a failed push."""
        return self._link.publish(await self.blocking(self.sender.revert_update))

    async def weights_digest(self, dtype: str) -> dict[str, str]:
        """sha256 of every weight cast to the engine's ``dtype``, by HF name."""
        return await self.blocking(lambda: digest_named(self.backend.named_weights(dtype)))

    async def local_weights(self, dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec] | None]:
        """This worker's weights in ``dtype`` (its shards, on the host) and their shard specs (for checks)."""
        weights = await self.blocking(self.backend.named_weights, dtype)
        return {k: v.detach().cpu() for k, v in weights.items()}, self.backend.shard_specs()

    async def save(self, path: str) -> None:
        await self.blocking(self.backend.save, path)

    async def load(self, path: str) -> None:
        await self.blocking(self.backend.load, path)

    async def save_state(self, path: str) -> None:
        """A run checkpoint's trainer part: :meth:`save` plus this worker's torch
        RNG state (``rng-rank<r>.pt``; every worker of a group writes its own)."""
        await self.blocking(self._save_state, path)

    def _save_state(self, path: str) -> None:
        self.backend.save(path)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(rng, pathlib.Path(path) / f"rng-rank{self.rank}.pt")

    async def load_state(self, path: str) -> None:
        """Take what :meth:`save_state` wrote (a worker of a different world size
        than the writer's finds no RNG file of its rank and keeps its own)."""
        await self.blocking(self._load_state, path)

    def _load_state(self, path: str) -> None:
        self.backend.load(path)
        rng_file = pathlib.Path(path) / f"rng-rank{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(rng["cuda"])


def _spread(samples: list[Sample], k: int) -> list[Sample]:
    """``k`` of ``samples`` at even spacing (a batch is whole groups: k groups' firsts when it has k)."""
    n = len(samples)
    return [samples[i * n // k] for i in range(min(k, n))]
