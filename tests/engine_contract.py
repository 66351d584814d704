"""The rollout-engine contract, as tests any engine can be run against.

Use: subclass :class:`EngineContract` in a ``test_*.py`` module and provide
two fixtures (tests/conftest.py has a ``make_update`` for an engine that takes
a sync manifest, and the ``tiny_models`` the tests run on):

    engine_factory(model_dir: str, **options) -> RolloutEngine   (not yet set up)
    make_update(version: int, state: dict[str, Tensor]) -> object  (what update_weights takes)

``options`` are ``max_num_seqs`` and ``max_model_len``. The suite builds tiny
Llama / Qwen2 / Qwen3 checkpoints (fp32) and checks the engine against
Hugging Face on the same weights. Concurrency is gated with ``pause`` /
``asyncio.Event``s and asserted on the order of events, never on time.
Every test body runs on the process's one loop (:func:`loop.run`, uvloop).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pytest
import torch
import transformers

import loop
from actors.engines.base import EngineAsleepError, GenerateOutput, GenerateRequest, RolloutEngine, SamplingParams

FAMILIES = ("qwen2", "llama", "qwen3")
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ([1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [42])


def build_tiny_model(family: str, path: Path, seed: int, wide_heads: bool = False) -> transformers.PreTrainedModel:
    """A random fp32 checkpoint of ``family`` saved at ``path``; returns the HF model.
    ``wide_heads``: head_dim 64 (2 heads of a 128-wide model), for engines whose
    kernels need it (vLLM's CPU build)."""
    heads = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1) if wide_heads else \
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    common = dict(num_hidden_layers=2, intermediate_size=128, vocab_size=96, rope_theta=5000.0,
                  max_position_embeddings=256, **heads)
    if family == "qwen2":
        cfg, cls = transformers.Qwen2Config(tie_word_embeddings=True, **common), transformers.Qwen2ForCausalLM
    elif family == "llama":
        cfg, cls = transformers.LlamaConfig(tie_word_embeddings=False, **common), transformers.LlamaForCausalLM
    elif family == "qwen3":
        cfg, cls = (transformers.Qwen3Config(tie_word_embeddings=True, head_dim=64 if wide_heads else 32, **common),
                    transformers.Qwen3ForCausalLM)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # random init is near-uniform; sharpen it so greedy ties are unlikely
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(response), V] (fp32) of each response token's position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def req(rid: str, prompt: list[int], max_tokens: int, sampling: SamplingParams = GREEDY) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=list(prompt), max_tokens=max_tokens, sampling=sampling)


def build_tiny_models(root: Path, wide_heads: bool = False) -> dict[str, tuple[str, object]]:
    """family -> (checkpoint dir under ``root``, HF model); plus "<family>-b": other
    weights, same shapes (the ``tiny_models`` fixture of tests/conftest.py)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        for suffix, seed in (("", 100 + i), ("-b", 200 + i)):
            path = root / (family + suffix)
            out[family + suffix] = (str(path), build_tiny_model(family, path, seed, wide_heads))
    return out


@contextlib.asynccontextmanager
async def running(factory, model_dir: str, **options):
    engine: RolloutEngine = factory(model_dir, **{"max_num_seqs": 4, "max_model_len": 128, **options})
    await engine.setup()
    try:
        yield engine
    finally:
        await engine.close()


def run(coro):
    return loop.run(coro)


@pytest.mark.timeout(60)
class EngineContract:
    """The contract. Subclasses provide ``engine_factory`` and ``make_update``.

    ``RAW_LOGPROBS_WHEN_WARPED``: the engine reports raw (T=1) log-probs beside
    the sampling ones under temperature / top-k / top-p too; an engine that
    gives one kind per run (vLLM) sets it False and leaves them empty there."""

    RAW_LOGPROBS_WHEN_WARPED = True

    @pytest.mark.parametrize("family", FAMILIES)
    def test_greedy_matches_hf_generate_token_for_token(self, engine_factory, tiny_models, family):
        path, hf = tiny_models[family]

        async def body():
            async with running(engine_factory, path, max_num_seqs=3) as engine:  # 4 prompts, 3 slots: one waits
                outs = await asyncio.gather(*(engine.generate(req(f"r{i}", p, 16)) for i, p in enumerate(PROMPTS)))
            return outs

        for prompt, out in zip(PROMPTS, run(body())):
            assert out.token_ids == hf_greedy(hf, prompt, 16)
            assert out.finish_reason == "length"
            assert len(out.logprobs) == len(out.raw_logprobs) == len(out.token_versions) == 16

    @pytest.mark.parametrize("family", FAMILIES)
    def test_logprobs_match_teacher_forced_hf_forward(self, engine_factory, tiny_models, family):
        path, hf = tiny_models[family]
        sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
        warpers = transformers.LogitsProcessorList([
            transformers.TemperatureLogitsWarper(0.8), transformers.TopKLogitsWarper(20),
            transformers.TopPLogitsWarper(0.9)])

        async def body():
            async with running(engine_factory, path) as engine:
                return await asyncio.gather(engine.generate(req("s", PROMPTS[0], 24, sampling)),
                                            engine.generate(req("g", PROMPTS[1], 24)))

        sampled, greedy = run(body())
        logits = hf_logprobs(hf, PROMPTS[0], sampled.token_ids)
        tokens = torch.tensor(sampled.token_ids)
        raw = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        processed = warpers(None, logits.clone()).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        if self.RAW_LOGPROBS_WHEN_WARPED:
            torch.testing.assert_close(torch.tensor(sampled.raw_logprobs), raw, atol=1e-4, rtol=0)
        else:
            assert sampled.raw_logprobs == []
        torch.testing.assert_close(torch.tensor(sampled.logprobs), processed, atol=1e-4, rtol=0)
        assert all(lp <= 0.0 for lp in sampled.logprobs)
        g_logits = hf_logprobs(hf, PROMPTS[1], greedy.token_ids).log_softmax(-1)
        g_raw = g_logits.gather(-1, torch.tensor(greedy.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(greedy.raw_logprobs), g_raw, atol=1e-4, rtol=0)

    def test_seeded_sampling_is_reproducible_whatever_the_batch(self, engine_factory, tiny_models):
        path, _ = tiny_models["qwen2"]
        sampling = SamplingParams(temperature=1.0, seed=1234)

        async def body():
            async with running(engine_factory, path) as engine:
                alone = await engine.generate(req("a", PROMPTS[0], 20, sampling))
                crowd = await asyncio.gather(
                    engine.generate(req("b", PROMPTS[0], 20, sampling)),
                    engine.generate(req("c", PROMPTS[2], 20, SamplingParams(temperature=1.0))),
                    engine.generate(req("d", PROMPTS[0], 20, SamplingParams(temperature=1.0, seed=99))))
            return alone, crowd

        alone, (same, _, other_seed) = run(body())
        assert alone.token_ids == same.token_ids
        assert alone.token_ids != other_seed.token_ids

    def test_stop_tokens_and_max_tokens_end_requests(self, engine_factory, tiny_models):
        path, hf = tiny_models["llama"]
        expected = hf_greedy(hf, PROMPTS[0], 12)
        stop = expected[5]
        cut = expected.index(stop) + 1

        async def body():
            async with running(engine_factory, path) as engine:
                return await asyncio.gather(
                    engine.generate(req("stop", PROMPTS[0], 12, SamplingParams(temperature=0, stop_token_ids=(stop,)))),
                    engine.generate(req("len", PROMPTS[0], 3)),
                    engine.generate(req("zero", PROMPTS[0], 0)))

        stopped, length, zero = run(body())
        assert stopped.token_ids == expected[:cut] and stopped.finish_reason == "stop"
        assert length.token_ids == expected[:3] and length.finish_reason == "length"
        assert zero.token_ids == [] and zero.finish_reason == "length"

    def test_abort_returns_exactly_the_tokens_produced_so_far(self, engine_factory, tiny_models):
        path, hf = tiny_models["qwen2"]

        async def body():
            async with running(engine_factory, path) as engine:
                seen: list[GenerateOutput] = []
                three = asyncio.Event()

                async def consume():
                    async for out in engine.stream(req("long", PROMPTS[0], 100)):
                        seen.append(out)
                        if len(out.token_ids) >= 3:
                            three.set()

                task = asyncio.create_task(consume())
                await three.wait()
                aborted = await engine.abort(["long"])
                await task
                nothing = await engine.abort(["long"])  # finished requests are not aborted twice
                return aborted, seen, nothing

        aborted, seen, nothing = run(body())
        assert len(aborted) == 1 and nothing == []
        out = aborted[0]
        assert out.finish_reason == "abort"
        assert seen[-1].finish_reason == "abort" and seen[-1].token_ids == out.token_ids
        assert 3 <= len(out.token_ids) < 100
        assert out.token_ids == hf_greedy(hf, PROMPTS[0], len(out.token_ids))
        assert len(out.logprobs) == len(out.raw_logprobs) == len(out.token_versions) == len(out.token_ids)
        for earlier in seen[:-1]:  # streams are cumulative
            assert out.token_ids[: len(earlier.token_ids)] == earlier.token_ids

    def test_resume_never_exceeds_budget_and_continues_the_same_sequence(self, engine_factory, tiny_models):
        path, hf = tiny_models["qwen3"]
        budget = 40

        async def body():
            async with running(engine_factory, path) as engine:
                first = asyncio.Event()

                async def consume():
                    async for out in engine.stream(req("r", PROMPTS[2], budget)):
                        if out.token_ids:
                            first.set()

                task = asyncio.create_task(consume())
                await first.wait()
                await engine.pause()
                (partial,) = await engine.abort(None)
                await engine.resume()
                await task
                rest = await engine.generate(
                    req("r", PROMPTS[2] + partial.token_ids, budget - len(partial.token_ids)))
                return partial, rest

        partial, rest = run(body())
        total = partial.token_ids + rest.token_ids
        assert partial.finish_reason == "abort" and rest.finish_reason == "length"
        assert len(total) == budget
        assert total == hf_greedy(hf, PROMPTS[2], budget)

    def test_weight_update_changes_outputs_to_the_new_weights(self, engine_factory, make_update, tiny_models):
        path, hf_a = tiny_models["qwen2"]
        _, hf_b = tiny_models["qwen2-b"]
        state_b = {k: v.detach().clone() for k, v in hf_b.state_dict().items()}

        async def body():
            async with running(engine_factory, path) as engine:
                assert engine.version == 0
                before = await engine.generate(req("a", PROMPTS[0], 12))
                # a request in flight across the update: its later tokens come from the new weights
                first = asyncio.Event()
                seen: list[GenerateOutput] = []

                async def consume():
                    async for out in engine.stream(req("x", PROMPTS[1], 40)):
                        seen.append(out)
                        if out.token_ids:
                            first.set()

                task = asyncio.create_task(consume())
                await first.wait()
                await engine.pause()
                num_old = len(seen[-1].token_ids)
                version = await engine.update_weights(make_update(1, state_b))
                await engine.resume()
                await task
                after = await engine.generate(req("b", PROMPTS[0], 12))
                return before, after, version, engine.version, seen[-1], num_old

        before, after, version, engine_version, crossing, num_old = run(body())
        assert before.token_ids == hf_greedy(hf_a, PROMPTS[0], 12)
        assert after.token_ids == hf_greedy(hf_b, PROMPTS[0], 12)
        assert version == engine_version == 1 and set(after.token_versions) == {1}
        k = crossing.token_versions.count(0)
        assert 1 <= num_old <= k < 40 and crossing.token_versions == [0] * k + [1] * (40 - k)
        old_part = crossing.token_ids[:k]
        assert old_part == hf_greedy(hf_a, PROMPTS[1], k)
        assert crossing.token_ids[k:] == hf_greedy(hf_b, PROMPTS[1] + old_part, 40 - k)

    def test_sleep_wake_round_trip_and_generating_asleep_raises(self, engine_factory, tiny_models):
        path, hf = tiny_models["llama"]
        expected = hf_greedy(hf, PROMPTS[0], 8)

        async def body():
            async with running(engine_factory, path) as engine:
                results = [(await engine.generate(req("0", PROMPTS[0], 8))).token_ids]
                for level in (1, 2):
                    await engine.sleep(level)
                    with pytest.raises(EngineAsleepError):
                        await engine.generate(req("asleep", PROMPTS[0], 8))
                    if level == 2:
                        await engine.wake_up(["weights"])  # KV cache still freed: still asleep
                        with pytest.raises(EngineAsleepError):
                            await engine.generate(req("half", PROMPTS[0], 8))
                    await engine.wake_up()
                    results.append((await engine.generate(req(str(level), PROMPTS[0], 8))).token_ids)
                return results

        assert run(body()) == [expected] * 3

    def test_requests_join_a_running_batch_between_decode_steps(self, engine_factory, tiny_models):
        path, hf = tiny_models["qwen2"]
        order: list[str] = []

        async def body():
            async with running(engine_factory, path) as engine:
                three = asyncio.Event()

                async def watch(rid: str, prompt: list[int], n: int):
                    last = None
                    async for out in engine.stream(req(rid, prompt, n)):
                        if out.token_ids and not order.count(rid + ":first"):
                            order.append(rid + ":first")
                        if len(out.token_ids) >= 3:
                            three.set()
                        last = out
                    order.append(rid + ":done")
                    return last

                long = asyncio.create_task(watch("long", PROMPTS[0], 40))
                await three.wait()
                await engine.pause()  # the long request has >= 3 and < 40 tokens now
                short = asyncio.create_task(watch("short", PROMPTS[2], 5))
                await asyncio.sleep(0)
                await engine.resume()
                return await long, await short

        long, short = run(body())
        assert long.token_ids == hf_greedy(hf, PROMPTS[0], 40)
        assert short.token_ids == hf_greedy(hf, PROMPTS[2], 5)
        assert order.index("short:first") < order.index("short:done") < order.index("long:done")

    def test_pause_holds_admitted_requests_until_resume(self, engine_factory, tiny_models):
        path, hf = tiny_models["qwen2"]

        async def body():
            async with running(engine_factory, path) as engine:
                await engine.pause()
                task = asyncio.create_task(engine.generate(req("p", PROMPTS[1], 6)))
                await asyncio.sleep(0)
                await engine.reset_prefix_cache()  # a command round trip: the request was seen, not run
                assert not task.done()
                await engine.resume()
                return await task

        assert run(body()).token_ids == hf_greedy(hf, PROMPTS[1], 6)

    def test_abort_all_ends_every_stream(self, engine_factory, tiny_models):
        path, _ = tiny_models["qwen3"]

        async def body():
            async with running(engine_factory, path, max_num_seqs=2) as engine:
                await engine.pause()
                tasks = [asyncio.create_task(engine.generate(req(f"r{i}", p, 50))) for i, p in enumerate(PROMPTS)]
                await asyncio.sleep(0)
                outs = await engine.abort(None)
                finals = await asyncio.gather(*tasks)
                await engine.resume()
                return outs, finals

        outs, finals = run(body())
        assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2", "r3"]
        assert all(f.finish_reason == "abort" and f.token_ids == [] for f in finals)

    def test_engine_thread_count_is_flat_over_many_requests(self, engine_factory, tiny_models):
        path, _ = tiny_models["qwen2"]

        async def body():
            async with running(engine_factory, path) as engine:
                await engine.generate(req("warm", PROMPTS[0], 2))
                before = set(threading.enumerate())
                for round_ in range(5):
                    await asyncio.gather(*(engine.generate(req(f"{round_}-{i}", p, 3)) for i, p in enumerate(PROMPTS)))
                return before, set(threading.enumerate())

        before, after = run(body())
        # threads started during the requests and still alive (the process count also moves when a
        # thread another test left behind ends, which is not this engine's doing)
        assert after - before == set()
