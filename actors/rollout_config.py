"""RolloutConfig: the ``rollout`` section (rollout actors, their engine, and
what they sample). The policies read it too, through the composed config."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from actors.engines.config import EngineConfig

__all__ = ["RolloutConfig"]

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]


class RolloutConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Rollout actors, each with its own engine, and their sampling."""

    num_actors: PosInt = 1
    """Rollout actors, each with its own engine."""
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    n: PosInt = 8
    """Samples per prompt (GRPO group size)."""
    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: NonNegInt = 0
    """0 = off."""
    max_response_tokens: PosInt = 16
    """Total new-token budget of a response, across every resume."""
    partial_rollout: bool = True
    """Keep and resume generations interrupted by a weight sync (else drop them, counted)."""
    max_respawns: NonNegInt = 100
    """Rollout actors that die are replaced by new ones, up to this many over the
    run (checkpoints carry the count). A replacement is set up beside the others
    and joins at the next weight push, which gives it the trainer's weights in
    full (at once when no rollout actor is left to push with). 0 = never: the run
    goes on with the actors left and stops when none is."""
