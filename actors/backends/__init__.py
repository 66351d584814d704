"""Trainer backends behind one protocol (:mod:`actors.backends.base`) and one factory.

    loss = policies.losses.make_loss_from_config(cfg.trainer)        # composition root
    backend = make_backend(cfg.trainer, model_path, seed=cfg.run.seed, loss=loss)
    backend.setup()

``trainer.backend`` names a backend of :mod:`actors.backends.registry`
(``torch``, built in; ``megatron``, which needs megatron-core, the ``megatron``
extra, and ``trainer.device=cuda``) or a user's backend by its import path. A
backend's module is imported only when it is built (each costs seconds:
transformers and torch's FSDP, megatron-core). The config loader refuses what
this machine cannot build first, naming ``trainer.backend``.
"""

from __future__ import annotations

from actors.backends.base import Loss, TrainerBackend
from actors.backends.config import TrainerConfig
from actors.backends.registry import BACKENDS, backend_unavailable, register_backend

__all__ = ["BACKENDS", "Loss", "TrainerBackend", "TrainerConfig", "backend_unavailable", "make_backend",
           "register_backend"]


def make_backend(cfg: TrainerConfig, model_path: str, *, seed: int, loss: Loss) -> TrainerBackend:
    """Build (not set up: ``backend.setup()``) the trainer backend ``cfg.backend`` names.

    ``loss``: the :class:`~actors.backends.base.Loss` to train with, built by
    the composition root (``policies.losses.make_loss_from_config(cfg.trainer)``).
    ``seed`` seeds initialisation. Raises ``ValueError`` naming
    ``trainer.backend`` for a backend this machine cannot build.
    """
    reason = backend_unavailable(cfg)
    if reason is not None:
        raise ValueError(f"trainer.backend: {reason}")
    backend = BACKENDS.factory(cfg.backend)(cfg, model_path, seed=seed, loss=loss)
    if not isinstance(backend, TrainerBackend):
        raise TypeError(f"trainer.backend: {cfg.backend!r} built a {type(backend).__name__}, not a TrainerBackend")
    return backend
