"""In-flight weight updates on the built-in engine: for each mode, which weights
produced which tokens.

Requests generate with weights A (version 0); a push swaps in weights B
(version 1) while they run. Every token's raw log-prob, as the engine reported
it, is recomputed with the Hugging Face model of the same checkpoint under what
the mode promises:

    abort      the requests end at the swap with their partial tokens, all A's
    keep       tokens after the swap come from B reading the KV cache A computed
               for the tokens before it (and B's own KV after)
    recompute  tokens after the swap come from B alone, over the whole sequence

Each mode's tokens match its own reference and not the other's, so the check
tells the modes apart.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.engines.torch_engine import TorchEngine
from actors.models import BUILTIN_MODEL_DIR, load_causal_lm
from contracts.rollout import GenerateRequest, SamplingParams
from sync import WeightSender
from sync.sequence import sync_weights

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

TOL = 1e-4  # the engine's fp32 kernels against Hugging Face's (CUDA: 1e-3)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # CUDA: decode steps overlapped, drained by the swap


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    old = load_causal_lm(BUILTIN_MODEL_DIR).float().eval()
    new = load_causal_lm(BUILTIN_MODEL_DIR).float().eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return old, new


@torch.no_grad()
def _full(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for every t >= 1 (index t - 1)."""
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def _close(got: list[float], ref: torch.Tensor, device: str) -> bool:
    return torch.allclose(torch.tensor(got), ref, atol=TOL if device == "cpu" else 10 * TOL)


@torch.no_grad()
def _kept(old: torch.nn.Module, new: torch.nn.Module, ids: list[int], split: int) -> torch.Tensor:
    """As :func:`_full` for t > split: ``old`` computed the KV of ``ids[:split]``,
    ``new`` reads it and computes the rest."""
    cache = old(torch.tensor([ids[:split]]), use_cache=True).past_key_values
    lp = torch.log_softmax(new(torch.tensor([ids[split:]]), past_key_values=cache).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(ids[split + 1:]).unsqueeze(1)).squeeze(1)


async def _swap_mid_generation(mode: str, device: str) -> tuple[list, list, object]:
    """Four requests generate with the checkpoint's weights; once each has a few
    tokens, ``mode`` swaps in the perturbed ones. Returns the prompts, the final
    outputs and the push's result."""
    old, new = _models()
    engine = TorchEngine(str(BUILTIN_MODEL_DIR), device=device, dtype="float32", max_num_seqs=8,
                         max_model_len=128, cuda_graphs=False, seed=3)
    await engine.setup()
    prompts = [[3 + (i * 5 + j) % 17 for j in range(4 + 3 * i)] for i in range(4)]
    seen = [asyncio.Event() for _ in prompts]

    async def run(i: int) -> object:
        last = None
        request = GenerateRequest(request_id=f"r{i}", prompt_ids=prompts[i], max_tokens=40,
                                  sampling=SamplingParams(temperature=1.0, seed=100 + i))
        async for last in engine.stream(request):
            if len(last.token_ids) >= 4:
                seen[i].set()
        seen[i].set()
        return last

    try:
        tasks = [asyncio.ensure_future(run(i)) for i in range(len(prompts))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen)), 30)
        sender = WeightSender(mode="full", dtype=torch.float32)
        result = await sync_weights([engine], sender, weights=new.state_dict(), version=1, colocated=False,
                                    in_flight=mode)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert engine.version == 1
    finally:
        await engine.close()
    return prompts, outs, (old, new, result)


@pytest.mark.parametrize("device", DEVICES)
async def test_abort_ends_the_running_requests_with_the_old_weights_tokens(device: str) -> None:
    prompts, outs, (old, _, result) = await _swap_mid_generation("abort", device)
    assert result.metrics.num_aborted == len(prompts) == len(result.aborted[0])
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "abort" and 4 <= len(out.token_ids) < 40
        assert set(out.token_versions) == {0}
        ids = prompt + out.token_ids
        assert _close(out.raw_logprobs, _full(old, ids)[len(prompt) - 1:], device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["keep", "recompute"])
async def test_running_requests_go_on_under_the_new_weights(mode: str, device: str) -> None:
    prompts, outs, (old, new, result) = await _swap_mid_generation(mode, device)
    assert result.metrics.num_aborted == 0 and result.aborted == [[]]
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 40
        versions = out.token_versions
        g = versions.index(1)  # the first token of the new weights; none of the old after it
        assert g >= 4 and set(versions[:g]) == {0} and set(versions[g:]) == {1}
        ids, p = prompt + out.token_ids, len(prompt)
        got = torch.tensor(out.raw_logprobs)
        assert _close(out.raw_logprobs[:g], _full(old, ids)[p - 1:p - 1 + g], device)
        # at the swap the KV held prompt + all old tokens but the last, which B then reads
        kept = _kept(old, new, ids, p + g - 1)
        recomputed = _full(new, ids)[p - 1 + g:]
        mine, other = (kept, recomputed) if mode == "keep" else (recomputed, kept)
        assert _close(out.raw_logprobs[g:], mine, device), (mode, (got[g:] - mine).abs().max())
        assert (got[g:] - other).abs().max() > 100 * TOL  # the other mode's reference does not fit


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_a_refused_swap_leaves_the_engine_generating_on_its_weights(mode: str) -> None:
    """A delta on another base is refused by the swap itself; the engine keeps its
    version and weights, and runs on (``abort``: what it aborted still ends)."""
    from sync import BaseVersionMismatch

    _, new = _models()
    engine = TorchEngine(str(BUILTIN_MODEL_DIR), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64,
                         cuda_graphs=False, seed=3)
    await engine.setup()
    try:
        before = {k: v.clone() for k, v in engine.named_weights().items()}
        sender = WeightSender(mode="delta", dtype=torch.float32)
        sender.encode(new.state_dict(), 4)  # the sender's base is now version 4, the engine's 0
        with torch.no_grad():
            next(new.parameters()).add_(1.0)
        delta = sender.encode(new.state_dict(), 5)
        assert delta.manifest.kind == "delta" and delta.manifest.base_version == 4
        task = asyncio.ensure_future(engine.generate(GenerateRequest(
            request_id="r", prompt_ids=[3, 4, 5], max_tokens=30, sampling=SamplingParams(temperature=1.0, seed=1))))
        await asyncio.sleep(0.05)
        with pytest.raises(BaseVersionMismatch):
            await engine.swap_weights(delta, mode)
        out = await asyncio.wait_for(task, 30)
        assert engine.version == 0 and set(out.token_versions) <= {0}
        assert out.finish_reason == ("abort" if mode == "abort" and len(out.token_ids) < 30 else "length")
        assert all(torch.equal(before[k], v) for k, v in engine.named_weights().items())
    finally:
        await engine.close()
