"""Trainer backends behind one protocol (:mod:`actors.backends.base`) and one factory.

    loss = policies.losses.make_loss_from_config(cfg.trainer)        # composition root
    backend = make_backend(cfg.trainer, model_path, seed=cfg.run.seed, loss=loss, mtp_layers=cfg.model.mtp_layers)
    backend.setup()

``trainer.backend`` names a backend of :mod:`actors.backends.registry`
(``torch``, built in; ``megatron``, which needs megatron-core, the ``megatron``
extra, and ``trainer.device=cuda``) or a user's backend by its import path. A
backend's module is imported only when it is built (each costs seconds:
transformers and torch's FSDP, megatron-core). The config loader refuses what
this machine cannot build first, naming ``trainer.backend``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from actors.backends.base import Loss, TrainerBackend
from actors.backends.config import TrainerConfig
from actors.backends.registry import BACKENDS, backend_unavailable, register_backend

__all__ = ["BACKENDS", "Loss", "TrainerBackend", "TrainerConfig", "backend_unavailable", "make_backend",
           "register_backend"]


def make_backend(cfg: TrainerConfig, model_path: str, *, seed: int, loss: Loss, mtp_layers: int = 0) -> TrainerBackend:
    """Build (not set up: ``backend.setup()``) the trainer backend ``cfg.backend`` names.

    ``loss``: the :class:`~actors.backends.base.Loss` to train with, built by
    the composition root (``policies.losses.make_loss_from_config(cfg.trainer)``).
    ``seed`` seeds initialisation. ``mtp_layers`` (``model.mtp_layers``): MTP modules
    to train, passed to the factory only when > 0 (docs/mtp.md). Raises ``ValueError``
    naming ``trainer.backend`` for a backend this machine cannot build, or one whose
    factory takes no ``mtp_layers`` when it is > 0.
    """
    reason = backend_unavailable(cfg)
    if reason is not None:
        raise ValueError(f"trainer.backend: {reason}")
    factory = BACKENDS.factory(cfg.backend)
    extra = {}
    if mtp_layers > 0:
        if not _takes(factory, "mtp_layers"):
            raise ValueError(f"trainer.backend {cfg.backend} does not support model.mtp_layers")
        extra["mtp_layers"] = mtp_layers
    backend = factory(cfg, model_path, seed=seed, loss=loss, **extra)
    if not isinstance(backend, TrainerBackend):
        raise TypeError(f"trainer.backend: {cfg.backend!r} built a {type(backend).__name__}, not a TrainerBackend")
    return backend


def _takes(factory: Callable[..., object], name: str) -> bool:
    """Whether ``factory`` accepts the keyword ``name`` (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read: assume it does not
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
