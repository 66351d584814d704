"""Rollout engines behind one protocol (:mod:`actors.engines.base`) and one factory.

    make_engine(cfg.rollout.engine, model_path, seed=cfg.run.seed)  # not set up: await engine.setup()

``rollout.engine.type`` names an engine of :mod:`actors.engines.registry`
(``torch``, built in; ``vllm`` where vLLM is installed; ``sglang``, an SGLang
server over HTTP) or a user's engine by its import path. An engine's module is
imported only when a config names it. The config loader refuses what this
machine cannot build first, naming ``rollout.engine.type``.
"""

from __future__ import annotations

import inspect

from actors.engines.base import (
    EngineAsleepError,
    GenerateOutput,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
)
from actors.engines.config import EngineConfig, check_speculative
from actors.engines.registry import ENGINES, engine_unavailable, register_engine
from actors.engines.weights import FullWeights

__all__ = [
    "ENGINES",
    "EngineAsleepError",
    "EngineConfig",
    "FullWeights",
    "GenerateOutput",
    "GenerateRequest",
    "RolloutEngine",
    "SamplingParams",
    "engine_unavailable",
    "make_engine",
    "register_engine",
]


def make_engine(cfg: EngineConfig, model_path: str, *, seed: int, mtp_layers: int = 0) -> RolloutEngine:
    """Build (not set up: ``await engine.setup()``) the rollout engine ``cfg.type`` names.

    ``seed`` seeds the per-request seeds of unseeded requests (the rollout
    actor's: the run's seed plus its index). ``mtp_layers`` (``model.mtp_layers``),
    when above 0, goes to the factory, which must take it. Raises ``ValueError``
    naming ``rollout.engine.type`` for an engine this machine cannot build.
    """
    reason = engine_unavailable(cfg)
    if reason is not None:
        raise ValueError(f"rollout.engine.type: {reason}")
    check_speculative(cfg.speculative, mtp_layers)
    factory = ENGINES.factory(cfg.type)
    options: dict[str, int] = {}
    if mtp_layers > 0:
        params = inspect.signature(factory).parameters
        if "mtp_layers" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise ValueError(f"rollout.engine.type: {cfg.type!r} does not take model.mtp_layers "
                             f"(its factory has no mtp_layers argument); set model.mtp_layers: 0")
        options["mtp_layers"] = mtp_layers
    engine = factory(cfg, model_path, seed=seed, **options)
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"rollout.engine.type: {cfg.type!r} built a {type(engine).__name__}, not a RolloutEngine")
    return engine
