"""How ``trainer.backend: torch`` is built from the ``trainer`` section (the
factory :mod:`actors.backends.registry` names), kept apart from the backend's
own module so the checks of a config stay next to each other and short."""

from __future__ import annotations

import logging

from actors.backends.base import Loss
from actors.backends.config import TrainerConfig
from actors.backends.kernels import kernels_unavailable
from actors.backends.torch_backend import TorchBackend

__all__ = ["torch_backend"]

_log = logging.getLogger(__name__)


def torch_backend(cfg: TrainerConfig, model_path: str, *, seed: int, loss: Loss, mtp_layers: int = 0) -> TorchBackend:
    """The torch backend ``cfg`` describes, not yet set up, with ``mtp_layers`` MTP modules
    (``model.mtp_layers``); ValueError, one line, for a setting it cannot serve."""
    if cfg.tensor_parallel_size != 1:
        raise ValueError(f"trainer.tensor_parallel_size: {cfg.tensor_parallel_size} needs backend: megatron "
                         f"(the torch backend is data parallel only)")
    if (reason := kernels_unavailable(cfg.kernels, cfg.device)) is not None:
        raise ValueError(f"trainer.kernels: {reason}")
    if mtp_layers and cfg.compile:
        raise ValueError("trainer.compile: not with model.mtp_layers > 0 (the MTP modules run from hooks on "
                         "the model's layers, which its compiled layers would trace)")
    cuda_graphs = bool(cfg.cuda_graphs)
    if mtp_layers and cuda_graphs:
        _log.warning("trainer.cuda_graphs: off, as model.mtp_layers > 0 (the MTP modules run outside the graphs)")
        cuda_graphs = False
    return TorchBackend(model_path, loss=loss, device=cfg.device, dtype=cfg.dtype, master_dtype=cfg.master_dtype,
                        lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, seed=seed,
                        micro_batch_tokens=cfg.micro_batch_tokens,
                        activation_checkpointing=cfg.activation_checkpointing, packed=cfg.packed,
                        logprob_chunk_tokens=cfg.logprob_chunk_tokens, compile=cfg.compile, kernels=cfg.kernels,
                        cuda_graphs=cuda_graphs, muon=cfg.muon if cfg.optimizer == "muon" else None,
                        mtp_layers=mtp_layers, mtp_loss_weight=cfg.mtp_loss_weight,
                        mtp_detach=cfg.mtp_detach, mtp_lr=cfg.mtp_lr)
