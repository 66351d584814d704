"""Trainer backends behind one protocol (:mod:`actors.backends.base`) and one factory.

    loss = policies.losses.make_loss_from_config(cfg.trainer)        # composition root
    backend = make_backend(cfg.trainer, model_path, seed=cfg.run.seed, loss=loss)
    backend.setup()

``backend: torch`` is built in; ``backend: megatron``
(:class:`~actors.backends.megatron_backend.MegatronBackend`) needs megatron-core
(the ``megatron`` extra) and ``trainer.device=cuda``, and is refused otherwise,
naming ``trainer.backend``.
"""

from __future__ import annotations

from actors.backends.base import Loss, TrainerBackend
from actors.backends.config import BACKEND_TYPES, TrainerConfig, backend_unavailable

__all__ = ["BACKEND_TYPES", "Loss", "TrainerBackend", "TrainerConfig", "make_backend"]


def make_backend(cfg: TrainerConfig, model_path: str, *, seed: int, loss: Loss) -> TrainerBackend:
    """Build (not set up: ``backend.setup()``) the trainer backend ``cfg`` names.

    ``loss``: the :class:`~actors.backends.base.Loss` to train with, built by
    the composition root (``policies.losses.make_loss_from_config(cfg.trainer)``).
    ``seed`` seeds initialisation. Raises ``ValueError`` naming
    ``trainer.backend`` for a backend this build does not have.
    """
    if cfg.backend == "megatron" and cfg.activation_checkpointing:  # wrong whether or not megatron-core is here
        raise ValueError("trainer.activation_checkpointing: the megatron backend does not offer it in this build "
                         "(backend: torch does)")
    reason = backend_unavailable(cfg.backend, cfg.device)
    if reason is not None:
        raise ValueError(f"trainer.backend: {reason}")
    if cfg.backend == "megatron":
        # imported here, as the torch backend below: each costs seconds (transformers, torch's
        # FSDP; megatron-core), and the config loader imports this package for its checks
        from actors.backends.megatron_backend import MegatronBackend

        return MegatronBackend(model_path, loss=loss, device=cfg.device, dtype=cfg.dtype,
                               master_dtype=cfg.master_dtype, lr=cfg.lr, weight_decay=cfg.weight_decay,
                               grad_clip=cfg.grad_clip, seed=seed, micro_batch_tokens=cfg.micro_batch_tokens,
                               tensor_parallel_size=cfg.tensor_parallel_size)
    if cfg.tensor_parallel_size != 1:
        raise ValueError(f"trainer.tensor_parallel_size: {cfg.tensor_parallel_size} needs backend: megatron "
                         f"(the torch backend is data parallel only)")
    from actors.backends.kernels import kernels_unavailable

    reason = kernels_unavailable(cfg.kernels, cfg.device)
    if reason is not None:
        raise ValueError(f"trainer.kernels: {reason}")
    from actors.backends.torch_backend import TorchBackend

    return TorchBackend(model_path, loss=loss, device=cfg.device, dtype=cfg.dtype, master_dtype=cfg.master_dtype,
                        lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, seed=seed,
                        micro_batch_tokens=cfg.micro_batch_tokens, activation_checkpointing=cfg.activation_checkpointing,
                        packed=cfg.packed, logprob_chunk_tokens=cfg.logprob_chunk_tokens,
                        compile=cfg.compile, kernels=cfg.kernels, cuda_graphs=cfg.cuda_graphs,
                        muon=cfg.muon if cfg.optimizer == "muon" else None)
