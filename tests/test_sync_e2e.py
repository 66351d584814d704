"""The sync sequence end to end with the built-in TorchEngine: a real
optimizer step, a full then a delta push while requests are in flight, the
aborted requests resumed on the new weights."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch

from sync import WeightSender
from sync.sequence import sync_weights

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.asyncio,
    pytest.mark.skipif(importlib.util.find_spec("actors.engines.torch_engine") is None,
                       reason="actors/engines/torch_engine.py (the built-in engine) is not in this tree yet"),
]


def _tiny_qwen2(path: Path) -> torch.nn.Module:
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=96, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (4, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


async def _in_flight(engine, ids: list[str], budget: int) -> tuple[asyncio.Event, list[asyncio.Task]]:
    """Start requests; the event fires once each has produced a few tokens."""
    from actors.engines.base import GenerateRequest

    num_tokens = dict.fromkeys(ids, 0)
    started = asyncio.Event()

    async def run(i: str) -> None:
        async for out in engine.stream(GenerateRequest(request_id=i, prompt_ids=[1, 2, 3], max_tokens=budget)):
            num_tokens[i] = len(out.token_ids)
            if min(num_tokens.values()) >= 2:
                started.set()

    return started, [asyncio.create_task(run(i)) for i in ids]


async def test_full_then_delta_sync_with_aborted_requests_resumed(tmp_path: Path) -> None:
    from actors.engines.base import GenerateRequest, SamplingParams
    from actors.engines.torch_engine import TorchEngine

    model = _tiny_qwen2(tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = TorchEngine(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=512,
                         cuda_graphs=False)
    await engine.setup()
    try:
        sender = WeightSender(mode="delta", dtype=torch.float32, bucket_bytes=1 << 14)
        budget, kinds = 200, []
        for version in (1, 2):
            _train_step(model, opt, version)
            ids = [f"v{version}-r{i}" for i in range(3)]
            started, tasks = await _in_flight(engine, ids, budget)
            await asyncio.wait_for(started.wait(), 30)
            result = await sync_weights([engine], sender, weights=model.state_dict(), version=version,
                                        colocated=True)
            await asyncio.gather(*tasks)
            kinds.append(result.metrics.kind)
            assert engine.version == version == result.version
            partials = {o.request_id: o for o in result.aborted[0]}
            assert set(partials) == set(ids), "every in-flight request comes back as a partial"
            for rid, part in partials.items():
                assert part.finish_reason == "abort" and 0 < len(part.token_ids) < budget
                assert set(part.token_versions) <= {version - 1}
                left = budget - len(part.token_ids)
                rest = await engine.generate(GenerateRequest(request_id=rid + "-resumed",
                                                             prompt_ids=[1, 2, 3, *part.token_ids], max_tokens=left))
                assert len(part.token_ids) + len(rest.token_ids) <= budget
                assert rest.token_ids and set(rest.token_versions) == {version}
        assert kinds == ["full", "delta"]
        # the engine computes with exactly the trainer's weights: same logits as HF
        prompt = torch.tensor([[5, 6, 7, 8]])
        with torch.no_grad():
            want = model(input_ids=prompt).logits[0, -1].argmax().item()
        out = await engine.generate(GenerateRequest(request_id="check", prompt_ids=[5, 6, 7, 8], max_tokens=1,
                                                    sampling=SamplingParams(temperature=0.0)))
        assert out.token_ids == [want]
    finally:
        await engine.close()
