"""TrainerActor: owns one trainer backend; turns batches into optimizer steps
and optimizer steps into weight updates.

Endpoints (all async; the work runs on the actor's worker thread):
    train_step(samples)       GRPO advantages, loss, one optimizer step -> metrics
    weight_update()           encode the current weights (full or delta) for the engines
    weights_refused()         a receiver refused a delta: next update is full
    observe(...)/revert_update()  cost feedback for sync.mode=auto; undo of a failed push
    save(dir) / load(dir)     checkpoint (safetensors + optimizer state)
"""

from __future__ import annotations

from typing import Any

from actors.runtime import Actor, quiet_transformers
from transfer_queue.sample import Sample

__all__ = ["TrainerActor"]


class TrainerActor(Actor):
    """One optimizer over the policy model (torch backend; megatron later)."""

    def __init__(self, *, backend: str, model_path: str, backend_kwargs: dict[str, Any],
                 sync_kwargs: dict[str, Any], torch_threads: int | None = None) -> None:
        self.backend_type, self.model_path = backend, model_path
        self.backend_kwargs, self.sync_kwargs = backend_kwargs, sync_kwargs
        self.torch_threads = torch_threads
        self.backend: Any = None
        self.sender: Any = None
        self._group: Any = None  # broadcast transport when weights go over torch.distributed
        self._pending: Any = None  # the payload of the last update, until broadcast
        self._ipc: Any = None  # CUDA IPC transport when engines map the payload from this GPU

    async def setup(self) -> None:
        await self.blocking(self._setup)

    def _setup(self) -> None:
        import torch

        from sync import WeightSender

        quiet_transformers()
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        if self.backend_type != "torch":
            raise ValueError(f"trainer.backend: {self.backend_type!r} is not available in this build "
                             "(expected torch)")
        from actors.backends.torch_backend import TorchBackend

        self.backend = TorchBackend(self.model_path, **self.backend_kwargs)
        self.backend.setup()
        kwargs = dict(self.sync_kwargs)
        kwargs["dtype"] = getattr(torch, kwargs.get("dtype", "float32"))
        self.sender = WeightSender(**kwargs)

    async def get_version(self) -> int:
        return self.backend.version

    async def train_step(self, samples: list[Sample]) -> dict[str, float]:
        return await self.blocking(self._train_step, samples)

    def _train_step(self, samples: list[Sample]) -> dict[str, float]:
        import torch

        from policies.advantages import grpo_advantages

        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        index: dict[str, int] = {}
        groups = torch.tensor([index.setdefault(s.group_id, len(index)) for s in samples])
        advantages = grpo_advantages(rewards, groups)
        metrics = self.backend.train_step(samples, advantages.tolist())
        metrics["reward_mean"] = float(rewards.mean())
        return metrics

    async def weight_update(self) -> Any:
        """The update that brings the engines to this trainer's current version."""
        return await self.blocking(self._weight_update)

    def _weight_update(self) -> Any:
        return self._outgoing(self.sender.encode(self.backend.named_weights(), self.backend.version))

    def _outgoing(self, update: Any) -> Any:
        if self._ipc is not None and update is not None:
            # the buckets stay here (kept until release_shared_buckets); engines map them
            return self._ipc.send(update)
        if self._group is None or update is None:
            return update
        # Broadcast mode: the payload stays here until broadcast_pending(); only
        # the manifest goes back to the driver.
        from sync.manifest import WeightUpdate

        self._pending = update
        return WeightUpdate(manifest=update.manifest, buckets=[])

    async def join_weight_group(self, init_method: str, world_size: int, backend: str) -> None:
        """Join the weight-sync process group as rank 0 (with every rollout actor at once)."""
        from actors.weight_group import join_group

        self._group = await self.blocking(join_group, init_method, 0, world_size, backend)

    async def share_by_cuda_ipc(self) -> None:
        """Hand updates out as CUDA IPC handles to their buckets on this GPU."""
        from sync.transport.cuda_ipc import CudaIpcTransport

        if self.backend.device.type != "cuda":
            raise ValueError(f"sync.transport=cuda_ipc needs the trainer on a GPU, it is on {self.backend.device}")
        self._ipc = CudaIpcTransport(self.backend.device)

    async def release_shared_buckets(self) -> None:
        """Let go of the buckets handed out since the last call (every engine has applied them)."""
        if self._ipc is not None:
            self._ipc.close()

    async def broadcast_pending(self) -> int:
        """Broadcast the last encoded update to the group; returns its bytes."""
        if self._pending is None:
            raise RuntimeError("broadcast_pending() without a weight_update() before it")
        update, self._pending = self._pending, None
        await self.blocking(self._group.send, update)
        return update.nbytes

    async def weights_refused(self) -> None:
        self.sender.force_full()

    async def observe(self, kind: str, *, encode_ms: float, transfer_ms: float, apply_ms: float) -> None:
        """Measured cost of the last sync (``sync.mode=auto`` picks full or delta from it)."""
        self.sender.observe(kind, encode_ms=encode_ms, transfer_ms=transfer_ms, apply_ms=apply_ms)

    async def revert_update(self) -> Any:
        """The update that takes engines back to the previous version after a failed push."""
        return self._outgoing(await self.blocking(self.sender.revert_update))

    async def weights_digest(self, dtype: str) -> dict[str, str]:
        """sha256 of every weight cast to the engine's ``dtype``, by HF name."""
        from actors.weight_group import digest_named

        return await self.blocking(lambda: digest_named(self.backend.named_weights(dtype)))

    async def save(self, path: str) -> None:
        await self.blocking(self.backend.save, path)

    async def load(self, path: str) -> None:
        await self.blocking(self.backend.load, path)
