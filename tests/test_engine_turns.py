"""The built-in engine's turns as a caller sees them: seeded requests sample the
same tokens whatever shares their batch, however steps are chained and
whenever they are admitted (pinned ids); a request's tokens reach the loop when
it ends (or every step when streamed) with the weight version that sampled
each one; a turn that ends no request does not wake the loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

import loop
from actors.engines import FullWeights
from actors.engines.torch_engine import TorchEngine
from actors.models import BUILTIN_MODEL_DIR
from contracts.rollout import GenerateRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)

# (temperature, top_k, top_p) by request, cycling: unit, tempered + top-p, greedy, top-k
_SAMPLING = ((1.0, 0, 1.0), (0.7, 0, 0.9), (0.0, 0, 1.0), (1.0, 5, 1.0))
_STOPS = ((5, 9), (), (17,), (3, 4, 6))

# what the engine sampled for _requests() on the built-in checkpoint before the host-path
# rework (one request at a time, steps not chained); every schedule below must give it
PINNED = {
    "r0": [4, 4, 4, 4, 4, 12],
    "r1": [8, 8, 8, 8, 11, 2, 19, 15, 2, 2, 2, 20, 2, 2, 2, 2, 2, 2, 2],
    "r2": [13, 4, 11, 13, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
    "r3": [8, 13, 5, 5, 6],
    "r4": [2, 2, 9],
    "r5": [6, 6, 8, 8, 8, 8, 8, 8, 15, 8, 8, 8, 8, 6, 8, 8, 8, 5, 5, 5, 5, 8, 8, 8, 8, 8, 8, 18, 8, 8, 8, 8, 8,
           8, 8, 8],
    "r6": [12, 12, 12, 2, 2, 2, 2, 12, 12, 12, 12, 12, 6, 6],
    "r7": [13, 10, 10, 13, 13, 10, 10, 10, 13, 10, 13, 4],
    "r8": [13, 6, 14, 6, 13, 6, 11, 1, 20, 5],
    "r9": [4, 4, 4, 2, 4, 4, 4, 7, 4, 4, 4, 4, 4, 4, 1, 4, 4, 4],
    "r10": [11, 11, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 11, 5, 11, 5],
    "r11": [4],
}


def _requests() -> list[GenerateRequest]:
    """Seeded requests of different prompts, samplers, stop tokens and budgets."""
    out = []
    for i in range(12):
        temperature, top_k, top_p = _SAMPLING[i % 4]
        prompt = [1 + (i * 7 + j * 3) % 20 for j in range(3 + (i * 5) % 11)]
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1000 + i,
                                  stop_token_ids=_STOPS[i % 4])
        out.append(GenerateRequest(request_id=f"r{i}", prompt_ids=prompt, max_tokens=6 + (i * 13) % 35,
                                   sampling=sampling))
    return out


async def _generate(max_num_seqs: int, overlap: bool, waves: int) -> dict[str, list[int]]:
    """The requests on one engine, submitted in ``waves`` (the later ones while the first decode)."""
    engine = TorchEngine(str(BUILTIN_MODEL_DIR), device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                         max_model_len=48, seed=5, overlap_steps=overlap)
    await engine.setup()
    try:
        requests = _requests()
        per_wave = -(-len(requests) // waves)
        tasks: list[asyncio.Task] = []
        for w in range(waves):
            wave = requests[w * per_wave : (w + 1) * per_wave]
            tasks += [asyncio.ensure_future(engine.generate(r)) for r in wave]
            if w + 1 < waves:  # the next wave joins a running batch
                while engine.statistics()["num_generated_tokens"] == 0:
                    await asyncio.sleep(0.001)
        outs = await asyncio.gather(*tasks)
    finally:
        await engine.close()
    return {o.request_id: o.token_ids for o in outs}


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
@pytest.mark.parametrize("max_num_seqs,waves", [(1, 1), (3, 2), (8, 3), (16, 1)])
def test_seeded_tokens_are_the_pinned_ones_whatever_the_batch(max_num_seqs: int, waves: int, overlap: bool):
    assert loop.run(_generate(max_num_seqs, overlap, waves)) == PINNED


@pytest.fixture
def engine_factory():
    return lambda model_dir, **options: TorchEngine(model_dir, device="cpu", dtype="float32", **options)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_generate_and_stream_agree_on_tokens_and_versions_across_a_kept_swap(tiny_models, overlap: bool):
    """One request generated, its twin (same prompt and seed) streamed; a swap
    that keeps them running lands mid-generation: both carry the same tokens,
    log-probs and per-token versions, 0 then 1."""
    path, _ = tiny_models["qwen2"]
    _, hf_b = tiny_models["qwen2-b"]
    update = FullWeights(version=1, tensors={k: v.detach().clone() for k, v in hf_b.state_dict().items()})
    sampling = SamplingParams(temperature=1.0, seed=11)

    async def body():
        engine = TorchEngine(path, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64,
                             overlap_steps=overlap)
        await engine.setup()
        try:
            await engine.pause()  # both admitted in one prefill
            generated = asyncio.ensure_future(engine.generate(GenerateRequest(
                request_id="g", prompt_ids=[1, 2, 3], max_tokens=30, sampling=sampling)))
            stream = engine.stream(GenerateRequest(request_id="s", prompt_ids=[1, 2, 3], max_tokens=30,
                                                   sampling=sampling))
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)  # the stream's request is submitted
            await engine.resume()
            last = await first
            swapped = False
            async for last in stream:
                if not swapped and len(last.token_ids) >= 4:
                    await engine.swap_weights(update, in_flight="keep")
                    swapped = True
            return await generated, last, engine.statistics()["num_generated_tokens"]
        finally:
            await engine.close()

    g, s, num_tokens = loop.run(body())
    assert g.token_ids == s.token_ids and len(g.token_ids) == 30
    # the twins are two rows of one batch: equal up to the row's place in the matmuls
    assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(s.logprobs), atol=1e-5)
    assert torch.allclose(torch.tensor(g.raw_logprobs), torch.tensor(s.raw_logprobs), atol=1e-5)
    assert g.token_versions == s.token_versions
    switch = g.token_versions.index(1)
    assert 4 <= switch < 30 and g.token_versions == [0] * switch + [1] * (30 - switch)
    assert num_tokens == 60


def test_a_turn_that_ends_no_request_does_not_wake_the_loop(tiny_models):
    """Requests admitted together and ending together reach the loop in one call."""
    path, _ = tiny_models["qwen2"]

    async def body():
        engine = TorchEngine(path, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64)
        await engine.setup()
        posts: list[int] = []
        post = engine._core._post

        def counting(events, callbacks):
            if events:
                posts.append(len(events))
            post(events, callbacks)

        engine._core._post = counting
        try:
            await engine.pause()
            tasks = [asyncio.ensure_future(engine.generate(GenerateRequest(
                request_id=str(i), prompt_ids=[1 + i, 2, 3], max_tokens=20, sampling=SamplingParams(seed=i))))
                for i in range(4)]
            await asyncio.sleep(0)
            await engine.resume()
            outs = await asyncio.gather(*tasks)
        finally:
            await engine.close()
        return posts, outs

    posts, outs = loop.run(body())
    assert all(len(o.token_ids) == 20 and o.finish_reason == "length" for o in outs)
    assert posts == [4]  # 20 steps, one post: the four ends


def test_overlapped_steps_keep_the_chain_across_ends_and_deliver_nothing_past_them():
    """All requests in one batch, overlapped: a request that stops or reaches
    its length (one at the cache's end) stays in the batch as an idle row, so
    ends break the chain of steps only once per few idle rows; the caller gets
    exactly what serial steps give, and only delivered tokens are counted."""
    from actors.engines.engine_steps import IDLE_ROWS_MIN

    requests = _requests() + [GenerateRequest(  # ends by length at the KV cache's last position
        request_id="long", prompt_ids=list(range(1, 21)), max_tokens=40, sampling=SamplingParams(seed=7))]

    async def body(overlap: bool):
        engine = TorchEngine(str(BUILTIN_MODEL_DIR), device="cpu", dtype="float32", max_num_seqs=16,
                             max_model_len=48, seed=5, overlap_steps=overlap)
        await engine.setup()
        try:
            await engine.pause()  # all admitted in one prefill: the chain is broken by ends only
            tasks = [asyncio.ensure_future(engine.generate(r)) for r in requests]
            await asyncio.sleep(0)
            await engine.resume()
            outs = await asyncio.gather(*tasks)
            return outs, engine.statistics()
        finally:
            await engine.close()

    serial, _ = loop.run(body(False))
    overlapped, stats = loop.run(body(True))
    assert {o.request_id: o.token_ids for o in overlapped} == {**PINNED, "long": serial[-1].token_ids}
    for a, b in zip(serial, overlapped):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.token_versions == b.token_versions
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert len(overlapped[-1].token_ids) == 48 - 20 and overlapped[-1].finish_reason == "length"
    assert stats["num_generated_tokens"] == sum(len(o.token_ids) for o in overlapped)
    # a break drops more than IDLE_ROWS_MIN idle rows at once, but the last (every row ended)
    assert 1 <= stats["num_chain_breaks"] <= len(requests) // (IDLE_ROWS_MIN + 1) + 1
