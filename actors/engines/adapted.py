"""What the adapters of external engines (``vllm_engine``, ``sglang_engine``) share.

    host copy        the weights in Hugging Face names, in the engine's dtype, read from
                     the checkpoint at setup; an update is applied to it with every check
                     (``sync.apply``), then the engine loads it, paused
    resubmission     a pause cuts the requests in flight; each stream parks with its
                     tokens and, on resume, is submitted again with them as prompt and
                     the rest of its budget (the same stream to the caller), so its KV
                     is recomputed on the weights of then

:class:`AdaptedEngine` holds both; an adapter adds how it submits, cuts, pauses
and loads (its ``stream``, ``abort``, ``_set_paused``, ``_set_memory`` and
``update_weights``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Generic, TypeVar

import torch
from safetensors.torch import load_file

from actors.engines.base import EngineAsleepError, RolloutEngine, copy_output
from actors.engines.weights import LM_HEAD, FullWeights, update_targets, with_tied_head
from contracts.rollout import GenerateOutput, GenerateRequest
from sync.apply import apply_update

__all__ = ["AdaptedEngine", "AdaptedStream", "first_of"]


async def first_of(*events: asyncio.Event) -> None:
    """Return when any of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class AdaptedStream:
    """One request as the caller sees it, across its submissions to the engine."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.out = GenerateOutput(request_id=request.request_id)
        self.aborted = False  # by the caller
        self.parked = asyncio.Event()  # cut by a pause, waiting for resume
        self.done = asyncio.Event()
        self.wake = asyncio.Event()  # resume or abort while parked


S = TypeVar("S", bound=AdaptedStream)  # the adapter's kind of stream


class AdaptedEngine(RolloutEngine, Generic[S]):
    """The host copy of the weights and the parked streams of an external engine.
    ``dtype`` is the engine's and the host copy's (one model's size of host memory)."""

    def __init__(self, model_path: str, *, device: str, dtype: str, max_num_seqs: int, max_model_len: int,
                 seed: int) -> None:
        self.model_path, self.device, self.dtype = model_path, device, dtype
        self.max_num_seqs, self.max_model_len, self.seed = max_num_seqs, max_model_len, seed
        self._version = 0
        self._streams: dict[str, S] = {}  # request id -> its stream
        self._paused = False
        self._freed: set[str] = set()  # what sleep freed: "weights", "kv_cache"
        self._weights: dict[str, torch.Tensor] = {}  # host copy, Hugging Face names, engine dtype
        self._tied = False  # lm_head is the embedding (not held apart)

    # ---- the host copy ---------------------------------------------------------------------------
    def _read_checkpoint(self) -> tuple[Path, bool]:
        """Read the checkpoint's weights into the host copy; return its directory and
        whether its config ties the output head to the embedding."""
        from actors.models import resolve_model_path  # imports transformers (~3 s): not for every engine import

        path = resolve_model_path(self.model_path)
        dtype = getattr(torch, self.dtype)
        for f in sorted(path.glob("*.safetensors")):
            self._weights.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
        config = json.loads((path / "config.json").read_text())
        return path, bool(config.get("tie_word_embeddings", False))

    async def _apply_to_host(self, update: object, *, require_all: bool) -> int:
        """Apply a ``sync`` update (checked first) or ``FullWeights`` to the host copy;
        return the version it brings. ``require_all``: a ``FullWeights`` must name
        every weight and no other (else it may update some of them)."""
        if not isinstance(update, FullWeights):
            targets = update_targets(self._weights, update, tied=self._tied)
            return await asyncio.to_thread(apply_update, targets, update, self._version)  # checks first
        tensors = {n: t for n, t in update.tensors.items() if not (self._tied and n == LM_HEAD)}
        if require_all:
            missing = sorted(set(self._weights) - set(tensors))
            unknown = sorted(set(tensors) - set(self._weights))
            if missing or unknown:
                raise ValueError(f"full weight update: missing {missing[:5]}, unknown {unknown[:5]}")
        dtype = getattr(torch, self.dtype)
        self._weights.update({n: t.detach().to("cpu", dtype) for n, t in tensors.items()})
        return int(update.version)

    async def _load_paused(self, load: Callable[[], Awaitable[None]], version: int) -> int:
        """Run ``load`` (the engine takes the host copy) paused, since requests in flight
        must not keep KV of the old weights; then hold ``version``."""
        was_paused = self._paused
        if not was_paused:
            await self.pause()
        try:
            await load()
            self._version = version
        finally:
            if not was_paused:
                await self.resume()
        return self._version

    def named_weights(self) -> dict[str, object]:
        """The weights last loaded into the engine, by Hugging Face name (the host copy
        updates are applied to, with checks). A tied ``lm_head.weight`` is listed
        too, as the embedding, like ``state_dict()``."""
        return with_tied_head(self._weights, self._tied)

    def statistics(self) -> dict[str, object]:
        return {"num_running": len(self._streams), "version": self._version}

    # ---- streams across submissions --------------------------------------------------------------
    def _check_new(self, request: GenerateRequest) -> None:
        """Refuse ``request`` while asleep or while one of its id runs."""
        if self._freed:
            raise EngineAsleepError("the engine is asleep: wake_up() first")
        if request.request_id in self._streams:
            raise ValueError(f"request {request.request_id!r} is already running")

    async def _park_if_paused(self, st: AdaptedStream) -> bool:
        """While paused, park ``st`` until resume or abort and return True (look
        again); else mark it unparked and return False (submit it)."""
        if self._paused:
            st.parked.set()
            st.wake.clear()
            await st.wake.wait()
            return True
        st.parked.clear()
        return False

    def _end(self, st: AdaptedStream) -> None:
        """``st``'s stream has ended (finished, aborted or failed)."""
        st.parked.set()
        st.done.set()
        self._streams.pop(st.request.request_id, None)

    def _mark_aborted(self, request_ids: list[str] | None) -> list[S]:
        """The streams ``request_ids`` name (all for None), marked aborted and woken if parked."""
        targets = list(self._streams.values()) if request_ids is None else \
            [self._streams[i] for i in request_ids if i in self._streams]
        for st in targets:
            st.aborted = True
            st.wake.set()
        return targets

    @staticmethod
    async def _outputs_when_done(streams: list[AdaptedStream]) -> list[GenerateOutput]:
        """The outputs of ``streams`` once each has ended."""
        await asyncio.gather(*(st.done.wait() for st in streams))
        return [copy_output(st.out) for st in streams]

    @staticmethod
    async def _until_parked(streams: list[AdaptedStream]) -> None:
        """Return once each of ``streams`` is parked or has ended (its cut output taken in)."""
        await asyncio.gather(*(first_of(st.parked, st.done) for st in streams))

    def _wake_all(self) -> None:
        for st in list(self._streams.values()):
            st.wake.set()
