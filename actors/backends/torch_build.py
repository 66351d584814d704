"""How ``trainer.backend: torch`` is built from the ``trainer`` section (the
factory :mod:`actors.backends.registry` names), kept apart from the backend's
own module so the checks of a config stay next to each other and short."""

from __future__ import annotations

from actors.backends.base import Loss
from actors.backends.config import TrainerConfig
from actors.backends.kernels import kernels_unavailable
from actors.backends.torch_backend import TorchBackend

__all__ = ["torch_backend"]


def torch_backend(cfg: TrainerConfig, model_path: str, *, seed: int, loss: Loss) -> TorchBackend:
    """The torch backend ``cfg`` describes, not yet set up; ValueError, one line, for a
    setting it cannot serve."""
    if cfg.tensor_parallel_size != 1:
        raise ValueError(f"trainer.tensor_parallel_size: {cfg.tensor_parallel_size} needs backend: megatron "
                         f"(the torch backend is data parallel only)")
    if (reason := kernels_unavailable(cfg.kernels, cfg.device)) is not None:
        raise ValueError(f"trainer.kernels: {reason}")
    return TorchBackend(model_path, loss=loss, device=cfg.device, dtype=cfg.dtype, master_dtype=cfg.master_dtype,
                        lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, seed=seed,
                        micro_batch_tokens=cfg.micro_batch_tokens,
                        activation_checkpointing=cfg.activation_checkpointing, packed=cfg.packed,
                        logprob_chunk_tokens=cfg.logprob_chunk_tokens, compile=cfg.compile, kernels=cfg.kernels,
                        cuda_graphs=cfg.cuda_graphs, muon=cfg.muon if cfg.optimizer == "muon" else None)
