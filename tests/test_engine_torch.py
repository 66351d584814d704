"""The engine contract run against the built-in TorchEngine on CPU (fp32),
plus what is particular to it: a preallocated KV cache, the factory."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import loop
from actors.engines import EngineConfig, FullWeights, make_engine
from actors.engines.torch_engine import TorchEngine
from tests.engine_contract import PROMPTS, EngineContract, hf_greedy, req, running


@pytest.fixture
def engine_factory():
    return lambda model_dir, **options: TorchEngine(model_dir, device="cpu", dtype="float32", **options)


@pytest.fixture
def make_update():
    # the built-in engine takes FullWeights as they are (conftest's default: a sync manifest)
    return lambda version, state: FullWeights(version=version, tensors=state)


class TestTorchEngineContract(EngineContract):
    pass


def test_statistics_carry_the_engine_threads_cpu_seconds(engine_factory, tiny_models):
    path, _ = tiny_models["qwen2"]

    async def body():
        async with running(engine_factory, path) as engine:
            before = engine.statistics()["thread_cpu_s"]
            await asyncio.gather(*(engine.generate(req(f"r{i}", p, 30)) for i, p in enumerate(PROMPTS)))
            return before, engine.statistics()

    before, after = loop.run(body())
    # the thread ran every decode step: its CPU time grew, by no more than the steps' own time
    assert 0 < after["thread_cpu_s"] - before <= after["turn_s"] + 0.05


def test_kv_cache_is_allocated_once_and_not_grown_by_decoding(engine_factory, tiny_models):
    path, _ = tiny_models["qwen2"]

    async def body():
        async with running(engine_factory, path) as engine:
            kv = engine._core.kv
            ptrs = [t.data_ptr() for t in kv.k + kv.v]
            await asyncio.gather(*(engine.generate(req(f"r{i}", p, 30)) for i, p in enumerate(PROMPTS)))
            return ptrs, [t.data_ptr() for t in kv.k + kv.v], engine.statistics()

    before, after, stats = loop.run(body())
    assert before == after
    assert stats["num_running"] == 0 and stats["kv_cache_bytes"] > 0


def test_sleep_frees_the_kv_cache_and_level_2_offloads_weights(engine_factory, tiny_models):
    path, _ = tiny_models["qwen2"]

    async def body():
        async with running(engine_factory, path) as engine:
            core = engine._core
            await engine.sleep(1)
            freed = (core.kv.allocated, core.weights.device.type)
            await engine.wake_up(["kv_cache"])
            await engine.sleep(2)
            offloaded = (core.kv.allocated, core.weights.device.type)
            await engine.wake_up()
            return freed, offloaded, core.kv.allocated

    freed, offloaded, restored = loop.run(body())
    assert freed == (False, "cpu") and offloaded == (False, "cpu") and restored


def test_full_weight_update_with_a_wrong_shape_is_refused_and_changes_nothing(engine_factory, tiny_models):
    path, hf = tiny_models["qwen2"]
    bad = {k: v.detach().clone() for k, v in tiny_models["qwen2-b"][1].state_dict().items()}
    bad["model.norm.weight"] = torch.ones(3)

    async def body():
        async with running(engine_factory, path) as engine:
            with pytest.raises(ValueError, match="model.norm.weight"):
                await engine.update_weights(FullWeights(version=1, tensors=bad))
            return engine.version, (await engine.generate(req("a", PROMPTS[0], 8))).token_ids

    version, tokens = loop.run(body())
    assert version == 0 and tokens == hf_greedy(hf, PROMPTS[0], 8)


def test_prompts_that_do_not_fit_are_a_clear_error(engine_factory, tiny_models):
    path, _ = tiny_models["llama"]

    async def body():
        async with running(engine_factory, path, max_model_len=16) as engine:
            with pytest.raises(ValueError, match="max_model_len"):
                await engine.generate(req("big", list(range(20)), 4))
            # an id outside the vocabulary is refused here, not by a device-side assert
            vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
            for bad in (vocab, -1):
                with pytest.raises(ValueError, match=f"token id {bad} is outside"):
                    await engine.generate(req("oov", [1, bad, 2], 4))
            # a response that runs into max_model_len ends with "length"
            return await engine.generate(req("edge", list(range(10)), 50))

    out = loop.run(body())
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_make_engine_builds_torch_from_its_section_and_names_missing_adapters(tiny_models):
    path, _ = tiny_models["qwen2"]
    cfg = EngineConfig(max_model_len=96)
    engine = make_engine(cfg, path, seed=5)
    assert isinstance(engine, TorchEngine)
    assert (engine.max_model_len, engine.max_num_seqs, engine._seed) == (96, cfg.max_num_seqs, 5)
    # one set of defaults: the engine built directly has the config's
    direct = TorchEngine(path)
    defaults = EngineConfig()
    assert (direct.max_model_len, direct.max_num_seqs, direct._compile_decode, direct._cuda_graphs) == (
        defaults.max_model_len, defaults.max_num_seqs, defaults.compile_decode, defaults.cuda_graphs)
    if importlib.util.find_spec("sglang") is None:  # without a url the adapter launches SGLang
        with pytest.raises(ValueError, match=r"^rollout\.engine\.type: 'sglang' is not available: sglang is not "
                                             r"installed; pip install -e \"\.\[sglang\]\""):
            make_engine(EngineConfig(type="sglang"), path, seed=0)
    if importlib.util.find_spec("vllm") is None:  # the adapter is here; the package may not be
        with pytest.raises(ValueError, match=r"^rollout\.engine\.type: 'vllm' is not available: vllm is not "
                                             r"installed; pip install -e \"\.\[vllm\]\""):
            make_engine(EngineConfig(type="vllm"), path, seed=0)
    with pytest.raises(ValueError, match=r"^rollout\.engine\.type: 'tgi' is unknown"):
        make_engine(EngineConfig(type="tgi"), path, seed=0)  # type: ignore[arg-type]


def test_unsupported_model_type_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')

    async def body():
        engine = TorchEngine(str(tmp_path))
        with pytest.raises(ValueError, match="gpt2"):
            await engine.setup()
        await engine.close()

    loop.run(body())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestTorchEngineContractCUDA(EngineContract):
    """The same contract on CUDA (fp32, decode as CUDA graphs)."""

    @pytest.fixture
    def engine_factory(self):
        return lambda model_dir, **options: TorchEngine(model_dir, device="cuda", dtype="float32", **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sleep_frees_cuda_memory_by_the_kv_cache_and_weights(tiny_models):
    path, _ = tiny_models["qwen2"]

    async def body():
        engine = TorchEngine(path, device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=1024)
        await engine.setup()
        try:
            await engine.generate(req("warm", PROMPTS[0], 4))
            base = torch.cuda.memory_allocated()
            await engine.sleep(1)
            level1 = base - torch.cuda.memory_allocated()
            await engine.wake_up()
            await engine.sleep(2)
            level2 = base - torch.cuda.memory_allocated()
            await engine.wake_up()
            stats = engine.statistics()
            out = await engine.generate(req("after", PROMPTS[0], 4))
            return level1, level2, stats, out
        finally:
            await engine.close()

    level1, level2, stats, out = loop.run(body())
    assert level1 >= stats["kv_cache_bytes"]
    assert level2 >= stats["kv_cache_bytes"] + stats["weights_bytes"]
    assert len(out.token_ids) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_auto_batch_on_cuda_is_sized_to_half_the_free_memory_and_reported(tiny_models):
    path, _ = tiny_models["qwen2"]
    cfg = EngineConfig(device="cuda", max_model_len=4096)  # max_num_seqs null: the engine sizes it

    async def body():
        engine = make_engine(cfg, path, seed=0)
        free_bytes, _ = torch.cuda.mem_get_info()
        await engine.setup()
        try:
            out = await engine.generate(req("after", PROMPTS[0], 4))
            return engine.max_num_seqs, engine.statistics(), free_bytes, out
        finally:
            await engine.close()

    num_seqs, stats, free_bytes, out = loop.run(body())
    assert cfg.max_num_seqs is None and stats["max_num_seqs"] == num_seqs and 1 <= num_seqs <= 256
    assert stats["kv_cache_bytes"] <= free_bytes / 2 and len(out.token_ids) == 4


def test_sync_full_then_delta_updates_apply_even_with_a_tied_lm_head_named(engine_factory, tiny_models):
    """``sync`` updates go through ``sync.apply``; a sender that does not dedup
    tied weights names ``lm_head.weight`` too, which must not break a delta."""
    sync = pytest.importorskip("sync")
    path, _ = tiny_models["qwen2"]
    _, hf_b = tiny_models["qwen2-b"]
    state_b = {k: v.detach().clone() for k, v in hf_b.state_dict().items()}
    state_b["lm_head.weight"] = state_b["model.embed_tokens.weight"].clone()  # untied copy, same values
    state_c = {k: v.clone() for k, v in state_b.items()}
    for name in ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"):
        state_c[name] = state_c[name] * 1.5 if name != "lm_head.weight" else state_c["model.embed_tokens.weight"]
    sender = sync.WeightSender(mode="delta", dtype=torch.float32, dedup_tied=False)

    async def body():
        async with running(engine_factory, path) as engine:
            await engine.update_weights(sender.encode(state_b, version=1))
            after_b = (await engine.generate(req("b", PROMPTS[0], 8))).token_ids
            update_c = sender.encode(state_c, version=2)
            await engine.update_weights(update_c)
            return after_b, update_c.manifest.kind, engine.version, engine._core.weights.params

    after_b, kind, version, params = loop.run(body())
    assert after_b == hf_greedy(hf_b, PROMPTS[0], 8)
    assert kind == "delta" and version == 2
    for name, want in state_c.items():
        if name != "lm_head.weight":
            assert torch.equal(params[name], want), name


def test_llama3_rope_scaling_matches_hf(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=96, max_position_embeddings=256,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    hf.save_pretrained(tmp_path)
    prompt = list(range(1, 40))  # positions past original_max_position_embeddings

    async def body():
        async with running(lambda d, **o: TorchEngine(d, **o), str(tmp_path)) as engine:
            return await engine.generate(req("a", prompt, 30))

    assert loop.run(body()).token_ids == hf_greedy(hf, prompt, 30)


def test_calls_after_close_are_a_clear_error(engine_factory, tiny_models):
    path, _ = tiny_models["qwen2"]

    async def body():
        async with running(engine_factory, path) as engine:
            pass
        with pytest.raises(RuntimeError, match="closed"):
            await engine.pause()
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate(req("late", PROMPTS[0], 2))
        await engine.close()  # idempotent

    loop.run(body())


def test_named_weights_are_the_hf_state_dict_bit_for_bit(engine_factory, tiny_models):
    path, hf = tiny_models["qwen2"]

    async def body():
        async with running(engine_factory, path) as engine:
            return {k: v.clone() for k, v in engine.named_weights().items()}

    got = loop.run(body())
    want = hf.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


class TestTorchEngineContractOverlappedSteps(EngineContract):
    """The same contract with decode steps chained on the device (CUDA's default):
    step k+1 is launched before step k's tokens are read back."""

    @pytest.fixture
    def engine_factory(self):
        return lambda model_dir, **options: TorchEngine(model_dir, device="cpu", dtype="float32",
                                                        overlap_steps=True, **options)


def test_a_planned_full_update_is_staged_while_generating_and_applied_after(engine_factory, tiny_models):
    """``stage_weights`` checks the payload between decode steps and writes
    nothing (a generation running through it stays on the old weights);
    ``update_weights`` of the same update then applies it."""
    sync = pytest.importorskip("sync")
    path, hf_a = tiny_models["qwen2"]
    _, hf_b = tiny_models["qwen2-b"]
    state_b = {k: v.detach().clone() for k, v in hf_b.state_dict().items()}
    update = sync.WeightSender(mode="full", dtype=torch.float32, device_plan="always").encode(state_b, version=1)
    assert update.manifest.layout  # the device fast path's layout, on CPU here

    async def body():
        async with running(engine_factory, path) as engine:
            before = {k: v.clone() for k, v in engine.named_weights().items()}
            gen = asyncio.ensure_future(engine.generate(req("a", PROMPTS[0], 8)))
            staged = await engine.stage_weights(update)
            unchanged = all(torch.equal(v, before[k]) for k, v in engine.named_weights().items())
            during = (await gen).token_ids
            version = await engine.update_weights(update)
            after = (await engine.generate(req("b", PROMPTS[0], 8))).token_ids
            return staged, unchanged, during, version, after

    staged, unchanged, during, version, after = loop.run(body())
    assert staged and unchanged and version == 1
    assert during == hf_greedy(hf_a, PROMPTS[0], 8)
    assert after == hf_greedy(hf_b, PROMPTS[0], 8)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_stage_leaves_the_decode_step_in_flight(tiny_models, device):
    """Overlapped steps: a stage reads the update only, so the chain of decode steps
    launched from the device's own tokens runs through it (a pause, by contrast,
    reads the step in flight back); the tokens are the unstaged run's. On CUDA the
    check runs on a stream of its own, beside the step in flight."""
    sync = pytest.importorskip("sync")
    path, _ = tiny_models["qwen2"]
    _, hf_b = tiny_models["qwen2-b"]
    update = sync.WeightSender(mode="full", dtype=torch.float32, device_plan="always").encode(
        {k: v.detach().clone().to(device) for k, v in hf_b.state_dict().items()}, version=1)

    async def body(command: str):
        engine = TorchEngine(path, device=device, dtype="float32", overlap_steps=True)
        await engine.setup()
        try:
            gen = asyncio.ensure_future(engine.generate(req("a", PROMPTS[0], 120)))  # to the 128-token cache
            for _ in range(4):
                await asyncio.sleep(0.002)
                if command == "stage":
                    assert await engine.stage_weights(update)
                elif command == "pause":
                    await engine.pause()
                    await engine.resume()
            return (await gen).token_ids, engine.statistics()["num_chain_breaks"]
        finally:
            await engine.close()

    plain, plain_breaks = loop.run(body("none"))
    staged, staged_breaks = loop.run(body("stage"))
    paused, paused_breaks = loop.run(body("pause"))
    assert staged == plain == paused and len(plain) == 120
    assert staged_breaks == plain_breaks < paused_breaks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_decode_graph_is_captured_at_setup_and_none_while_generating(tiny_models):
    """No capture (nor a Triton compile of a new batch size) lands in a run's steps."""
    path, _ = tiny_models["qwen2"]

    async def body():
        engine = TorchEngine(path, device="cuda", dtype="bfloat16", max_num_seqs=40, max_model_len=256)
        await engine.setup()
        try:
            graphs = engine._core.graphs
            captured = dict(graphs._graphs)
            outs = await asyncio.gather(*(engine.generate(req(f"r{i}", PROMPTS[i % len(PROMPTS)], 1 + 3 * i))
                                          for i in range(40)))  # 40 rows ending one by one: every bucket down to 1
            return graphs, captured, outs, engine.statistics()
        finally:
            await engine.close()

    graphs, captured, outs, stats = loop.run(body())
    assert sorted(captured) == graphs.buckets == [1, 2, 4, 8, 16, 32, 40]
    assert graphs._graphs == captured and stats["graph_capture_s"] > 0
    assert all(0 < len(o.token_ids) <= 1 + 3 * i for i, o in enumerate(outs))
