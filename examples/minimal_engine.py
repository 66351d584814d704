"""A minimal rollout engine: Hugging Face ``transformers`` forward passes, one token
for every running request a step, no KV cache (each step recomputes each prefix:
slow, but whole). It passes the engine contract (tests/engine_contract.py).

    rollout:
      engine:
        type: examples.minimal_engine:MinimalEngine
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import torch
import transformers

from actors.engines import EngineAsleepError, EngineConfig, GenerateOutput, GenerateRequest, RolloutEngine
from actors.engines.base import copy_output
from actors.engines.weights import update_targets
from actors.models import load_causal_lm
from sync.apply import apply_update


class _Sequence:
    """One request: its output so far, its random stream, and the event its stream waits on."""

    def __init__(self, request: GenerateRequest, seed: int) -> None:
        self.request = request
        self.out = GenerateOutput(request_id=request.request_id)
        self.generator = torch.Generator().manual_seed(seed)
        self.changed = asyncio.Event()


class MinimalEngine(RolloutEngine):
    """Built by ``make_engine`` as ``MinimalEngine(cfg, model_path, seed=seed)``."""

    def __init__(self, cfg: EngineConfig, model_path: str, *, seed: int) -> None:
        self.cfg, self.model_path = cfg, model_path
        self._seeds = itertools.count(seed * 1_000_003)  # for unseeded requests
        self._sequences: dict[str, _Sequence] = {}  # admitted, oldest first: the first max_num_seqs run
        self._paused = False
        self._freed: set[str] = set()  # what sleep freed
        self._task: asyncio.Task | None = None  # the step loop, while it has work
        self._error: BaseException | None = None  # what ended it

    async def setup(self) -> None:
        model = await asyncio.to_thread(load_causal_lm, self.model_path, device=self.cfg.device,
                                        dtype=getattr(torch, self.cfg.dtype))  # what the trainer loads
        self.model = model.eval().requires_grad_(False)

    def _kick(self) -> None:
        """Start the step loop unless it runs (it ends when it has nothing to do)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._steps())

    def _runnable(self) -> list[_Sequence]:
        """The sequences the next step advances: the oldest ``max_num_seqs``; none while paused or asleep."""
        if self._paused or self._freed:
            return []
        return list(self._sequences.values())[: self.cfg.max_num_seqs]

    async def _steps(self) -> None:
        try:
            while running := self._runnable():
                for seq in running:
                    self._step(seq)
                await asyncio.sleep(0)  # abort, pause and new requests come in between steps
        except Exception as e:  # the streams raise it: nothing fails silently
            self._error = e
            for seq in self._sequences.values():
                seq.changed.set()

    def _step(self, seq: _Sequence) -> None:
        """One more token for ``seq``, or its end."""
        request, out = seq.request, seq.out
        if len(out.token_ids) < request.max_tokens and self._room(seq):
            token, logprob, raw_logprob = self._next_token(seq)
            out.token_ids.append(token)
            out.logprobs.append(logprob)
            out.raw_logprobs.append(raw_logprob)
            out.token_versions.append(self._version)
            if token in request.sampling.stop_token_ids:
                self._finish(seq, "stop")
                return
        if len(out.token_ids) >= request.max_tokens or not self._room(seq):
            self._finish(seq, "length")
        else:
            seq.changed.set()

    @torch.no_grad()
    def _next_token(self, seq: _Sequence) -> tuple[int, float, float]:
        """``seq``'s next token, its log-prob under the sampling distribution and the raw one."""
        ids = torch.tensor([seq.request.prompt_ids + seq.out.token_ids], device=self.cfg.device)
        logits = self.model(ids).logits[0, -1].float().cpu()  # [vocab]
        raw = logits.log_softmax(-1)
        sampling = seq.request.sampling
        if sampling.temperature == 0:  # greedy: the log-probs of the unmodified distribution
            token = int(logits.argmax())
            return token, float(raw[token]), float(raw[token])
        warpers = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(sampling.temperature)])
        if sampling.top_k > 0:
            warpers.append(transformers.TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            warpers.append(transformers.TopPLogitsWarper(sampling.top_p))
        logprobs = warpers(None, logits[None])[0].log_softmax(-1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=seq.generator))
        return token, float(logprobs[token]), float(raw[token])

    def _room(self, seq: _Sequence) -> bool:
        return len(seq.request.prompt_ids) + len(seq.out.token_ids) < self.cfg.max_model_len

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.out.finish_reason = reason
        del self._sequences[seq.request.request_id]
        seq.changed.set()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if self._error is not None:
            raise RuntimeError("the engine's step loop failed") from self._error
        if self._freed:
            raise EngineAsleepError("the engine is asleep: wake_up() first")
        if request.request_id in self._sequences:
            raise ValueError(f"request {request.request_id!r} is already running")
        if len(request.prompt_ids) >= self.cfg.max_model_len:
            raise ValueError(f"a prompt of {len(request.prompt_ids)} tokens leaves none of max_model_len")
        seed = request.sampling.seed if request.sampling.seed is not None else next(self._seeds)
        seq = self._sequences[request.request_id] = _Sequence(request, seed)
        self._kick()
        try:
            while True:
                await seq.changed.wait()
                seq.changed.clear()
                if self._error is not None:
                    raise RuntimeError("the engine's step loop failed") from self._error
                yield copy_output(seq.out)
                if seq.out.finish_reason is not None:
                    return
        finally:  # the caller stopped listening: the request ends
            if self._sequences.get(request.request_id) is seq:
                del self._sequences[request.request_id]

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        ids = list(self._sequences) if request_ids is None else [i for i in request_ids if i in self._sequences]
        seqs = [self._sequences[i] for i in ids]
        for seq in seqs:
            self._finish(seq, "abort")
        return [copy_output(seq.out) for seq in seqs]

    async def update_weights(self, update: object) -> int:
        # a sync update (full or delta), checked as it is written into the parameters in place
        weights = dict(self.model.named_parameters())  # a tied lm_head is the embedding: not listed
        targets = update_targets(weights, update, tied=self.model.config.tie_word_embeddings)
        self._version = apply_update(targets, update, self._version)
        return self._version

    async def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        self._kick()

    async def _set_memory(self, tags: list[str], *, resident: bool) -> None:
        # there is no KV cache to free; the weights go to host memory and back
        if "weights" in tags:
            self.model.to(self.cfg.device if resident else "cpu")
        self._freed = self._freed - set(tags) if resident else self._freed | set(tags)
        self._kick()

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    async def close(self) -> None:
        await self.abort(None)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
