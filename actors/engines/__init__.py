"""Rollout engines behind one protocol (:mod:`actors.engines.base`) and one factory.

    make_engine(cfg.rollout.engine, model_path, seed=cfg.run.seed)  # not set up: await engine.setup()

``type: torch`` is built in; ``vllm`` runs where vLLM is installed
(``actors/engines/vllm_engine.py``); ``sglang`` talks to an SGLang server over
HTTP (``actors/engines/sglang_engine.py``): the one at ``url``, or one it
launches where SGLang is installed. The config loader refuses what this machine
cannot build first, naming ``rollout.engine.type``.
"""

from __future__ import annotations

from actors.engines.base import (
    EngineAsleepError,
    GenerateOutput,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
)
from actors.engines.config import ENGINE_TYPES, EngineConfig, engine_unavailable
from actors.engines.sglang_engine import SglangEngine  # needs no sglang package: it speaks HTTP
from actors.engines.torch_engine import TorchEngine
from actors.engines.vllm_engine import VllmEngine  # imports vllm in setup(), where it is installed
from actors.engines.weights import FullWeights

__all__ = [
    "ENGINE_TYPES",
    "EngineAsleepError",
    "EngineConfig",
    "FullWeights",
    "GenerateOutput",
    "GenerateRequest",
    "RolloutEngine",
    "SamplingParams",
    "make_engine",
]


def make_engine(cfg: EngineConfig, model_path: str, *, seed: int) -> RolloutEngine:
    """Build (not set up: ``await engine.setup()``) the rollout engine ``cfg`` names.

    ``seed`` seeds the per-request seeds of unseeded requests (the rollout
    actor's: the run's seed plus its index). Raises ``ValueError`` naming
    ``rollout.engine.type`` for an engine this build does not have.
    """
    reason = engine_unavailable(cfg.type, cfg.url)
    if reason is not None:
        raise ValueError(f"rollout.engine.type: {reason}")
    if cfg.type == "sglang":
        return SglangEngine(model_path, url=cfg.url, device=cfg.device, dtype=cfg.dtype,
                            max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, seed=seed)
    if cfg.type == "vllm":
        return VllmEngine(model_path, device=cfg.device, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
                          max_model_len=cfg.max_model_len, seed=seed)
    return TorchEngine(model_path, device=cfg.device, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
                       max_model_len=cfg.max_model_len, seed=seed, cuda_graphs=cfg.cuda_graphs,
                       compile_decode=cfg.compile_decode)
