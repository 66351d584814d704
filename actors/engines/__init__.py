"""Rollout engines behind one protocol (:mod:`actors.engines.base`) and one factory.

    make_engine("torch", model_path, device="cuda", max_num_seqs=256)  # built-in
    make_engine("vllm" | "sglang", ...)                                  # adapters: a later build
"""

from __future__ import annotations

from actors.engines.base import (
    EngineAsleepError,
    GenerateOutput,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
)
from actors.engines.weights import FullWeights

ENGINE_TYPES = ("torch", "vllm", "sglang")

__all__ = [
    "ENGINE_TYPES",
    "EngineAsleepError",
    "FullWeights",
    "GenerateOutput",
    "GenerateRequest",
    "RolloutEngine",
    "SamplingParams",
    "make_engine",
]


def make_engine(type: str, model_path: str, **kwargs) -> RolloutEngine:
    """Build (not set up: ``await engine.setup()``) a rollout engine by ``type``."""
    if type == "torch":
        from actors.engines.torch_engine import TorchEngine

        return TorchEngine(model_path, **kwargs)
    if type in ("vllm", "sglang"):
        raise ValueError(
            f"engine type={type!r}: the {type} adapter is not available in this build "
            "(only 'torch' is; the vLLM / SGLang adapters come with a later release)"
        )
    raise ValueError(f"engine type={type!r} is unknown; expected one of {ENGINE_TYPES}")
