"""The rollout-engine protocol shared by the built-in torch engine and the
vLLM / SGLang adapters.

Token ids in; token ids, per-token log-probs, the weight version of every
token and a finish reason out. The mapping onto the external engines:

    this protocol            vLLM AsyncLLM                      SGLang HTTP server
    generate/stream          generate()                         POST /generate (stream: server-sent events)
    abort(ids|None)          abort() -> partial RequestOutput   POST /abort_request
    pause()/resume()         pause_generation(mode=...)         /pause_generation (abort) + /continue_generation
    sleep(1|2)/wake_up(tags) sleep(level)/wake_up(tags)         /release_memory_occupation, /resume_memory_occupation
    update_weights(update)   collective_rpc (reload_weights)    /update_weights_from_disk (a host copy, checked)
    reset_prefix_cache()     reset_prefix_cache()               /flush_cache
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Literal

from contracts.rollout import GenerateOutput, GenerateRequest, SamplingParams


class EngineAsleepError(RuntimeError):
    """Raised when asked to generate while the engine sleeps."""


class RolloutEngine(abc.ABC):
    """A generation engine owned by one rollout actor (one event loop)."""

    @abc.abstractmethod
    async def setup(self) -> None:
        """Load weights, allocate caches, start the generation loop."""

    @abc.abstractmethod
    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yield cumulative outputs as tokens arrive; the last has a finish_reason."""

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Run one request to completion (or abort) and return its output."""
        last = GenerateOutput(request_id=request.request_id)
        async for out in self.stream(request):
            last = out
        return last

    @abc.abstractmethod
    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        """Stop the given requests (all when ``None``); return their partial
        outputs with ``finish_reason='abort'``. Their streams end with the same."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop scheduling new decode steps (admitted requests wait)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Undo :meth:`pause`."""

    @abc.abstractmethod
    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and also the weights (level 2)."""

    @abc.abstractmethod
    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed (``tags``: "weights", "kv_cache"; None = all)."""

    @abc.abstractmethod
    async def update_weights(self, update: object) -> int:
        """Apply a ``sync`` weight update (full or delta); return the new version.
        Invalidates every cache computed with the old weights."""

    async def stage_weights(self, update: object) -> bool:
        """Check ``update`` ahead of :meth:`update_weights`, writing nothing,
        while requests still run, so that the apply with the engine paused
        only copies. True when checked; False (the default) when
        :meth:`update_weights` checks as it applies. Raises for a corrupt payload."""
        return False

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Drop any prefix / KV cache reuse state."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The weight version the engine holds now."""

    def named_weights(self) -> dict[str, object]:
        """The weights the engine holds, by Hugging Face name (read-only views;
        for bit-exactness checks against the trainer). Optional for adapters."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights")

    async def close(self) -> None:
        """Stop the generation loop and free memory."""
