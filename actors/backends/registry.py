"""The trainer backends ``trainer.backend`` can name, declared as rollout engines
are (:mod:`actors.engines.registry`; the registry itself: :mod:`actors.registry`).

    torch      actors/backends/torch_backend.py      built in (actors/backends/torch_build.py)
    megatron   actors/backends/megatron_backend.py   megatron-core installed, trainer.device=cuda

A backend's factory is called as ``factory(cfg, model_path, seed=seed, loss=loss)``
(and ``mtp_layers=K`` when ``model.mtp_layers`` K > 0: a factory without that keyword
is refused for it) with ``cfg`` the ``trainer`` section (:class:`~actors.backends.config.TrainerConfig`)
and returns a :class:`~actors.backends.base.TrainerBackend`, not yet set up. A config
names a registered backend, or any such factory by its import path
(``trainer.backend: my_backends:MyBackend``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actors.backends.config import TrainerConfig, import_error
from actors.registry import Registry

__all__ = ["BACKENDS", "backend_unavailable", "register_backend"]

BACKENDS: Registry[TrainerConfig] = Registry("trainer.backend")

#: The package the megatron backend needs (the ``megatron`` extra installs it).
MEGATRON_PACKAGE = "megatron.core"


def register_backend(name: str, factory: str | Callable[..., Any], *,
                     check: Callable[[TrainerConfig], str | None] | None = None) -> None:
    """Let ``trainer.backend`` name ``name``, built by ``factory(cfg, model_path, seed=seed,
    loss=loss)`` (or the import path ``package.module:attr`` of it); ``check(cfg)``: why
    this machine cannot build it, or None (see :meth:`actors.registry.Registry.register`)."""
    BACKENDS.register(name, factory, check=check)


def backend_unavailable(cfg: TrainerConfig) -> str | None:
    """Why this machine cannot build the backend ``cfg`` names, as the tail of an error
    about ``trainer.backend`` (one line); None when it can."""
    return BACKENDS.unavailable(cfg.backend, cfg)


def _megatron_buildable(cfg: TrainerConfig) -> str | None:
    """megatron-core imports here (for real: a few seconds, only for a config that
    names it, so a broken install is caught at load), and the models go on CUDA."""
    why = import_error(MEGATRON_PACKAGE)
    if why is not None:
        return (f"'megatron' is not available: this build has no megatron backend without {MEGATRON_PACKAGE}, "
                f"which {why}; install the optional extra: pip install -e \".[megatron]\"")
    if not str(cfg.device).startswith("cuda"):
        return (f"'megatron' is not available: this build has no megatron backend for trainer.device="
                f"{str(cfg.device)!r} (its models run on CUDA only); set trainer.device=cuda")
    return None


register_backend("torch", "actors.backends.torch_build:torch_backend")
register_backend("megatron", "actors.backends.megatron_backend:MegatronBackend.from_config",
                 check=_megatron_buildable)
