"""Speculative decoding with MTP drafts in the built-in engine (CPU, fp32): greedy
output and recorded log-probs are the full model's token for token, sampled
tokens follow the full model's distribution (a chi-square test that a broken
acceptance rule fails), stops and lengths cut an accepted run, and no draft
state outlives an abort or a weight update. The engine contract runs with
speculation on too."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

import loop
from actors.config import ConfigError, load_config
from actors.engines import EngineConfig, FullWeights, make_engine
from actors.engines import spec_sampling, speculative
from actors.engines.model import ModelConfig
from actors.engines.torch_engine import TorchEngine
from actors.engines.weights import WeightStore
from contracts.rollout import GenerateOutput, SamplingParams
from tests.engine_contract import PROMPTS, EngineContract, hf_logprobs, req, running

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0.0)


def spec_engine(path: str, K: int, **options) -> TorchEngine:
    return TorchEngine(path, device="cpu", dtype="float32", mtp_layers=K, speculative="mtp", **options)


def plain_engine(path: str, **options) -> TorchEngine:
    return TorchEngine(path, device="cpu", dtype="float32", **options)


def with_drafts(src: str, dst: Path, K: int, scale: float, seed: int) -> str:
    """A copy of checkpoint ``src`` at ``dst`` carrying K MTP modules: the spec's
    initialisation plus Gaussian noise of ``scale`` times each tensor's spread."""
    shutil.copytree(src, dst)
    store = WeightStore(ModelConfig.from_dir(src), torch.device("cpu"), torch.float32, mtp_layers=K)
    store.load_dir(src)
    gen = torch.Generator().manual_seed(seed)
    mtp = {}
    for name, t in store.params.items():
        if name.startswith("mtp."):
            spread = t.std() if t.numel() > 1 and t.std() > 0 else torch.tensor(1.0)
            mtp[name] = (t + scale * spread * torch.randn(t.shape, generator=gen)).contiguous()
    save_file(mtp, str(dst / "mtp.safetensors"))
    return str(dst)


async def _generate_all(engine, requests):
    await engine.setup()
    try:
        outs = await asyncio.gather(*(engine.generate(r) for r in requests))
        return outs, engine.statistics()
    finally:
        await engine.close()


def generate(engine, requests) -> tuple[list[GenerateOutput], dict[str, float]]:
    return loop.run(_generate_all(engine, requests))


# ---- greedy and log-probs: the full model's ---------------------------------------------------
@pytest.fixture(scope="module")
def drafted(tiny_models, tmp_path_factory):
    """qwen2 tiny model: K -> checkpoint with perturbed MTP modules (acceptance about half the spec init's)."""
    root = tmp_path_factory.mktemp("drafted")
    path, _ = tiny_models["qwen2"]
    return {K: with_drafts(path, root / f"k{K}", K, scale=0.3, seed=K) for K in (1, 2)}


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("drafts", ["init", "perturbed"])
def test_greedy_with_speculation_equals_without_token_for_token(tiny_models, drafted, K, drafts):
    path = tiny_models["qwen2"][0] if drafts == "init" else drafted[K]
    requests = [req(f"r{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, (5, 17, 30, 41)))]
    base, _ = generate(plain_engine(path, max_num_seqs=3), requests)
    spec, st = generate(spec_engine(path, K, max_num_seqs=3), requests)  # 4 prompts, 3 slots: one waits
    for a, b in zip(base, spec):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(b.raw_logprobs), torch.tensor(a.raw_logprobs), atol=1e-4, rtol=0)
        assert b.token_versions == [0] * len(b.token_ids)
    assert st["num_spec_steps"] > 0 and 0 < st["num_accepted_draft_tokens"] < st["num_draft_tokens"]
    if drafts == "init":  # fewer steps than tokens: runs of drafts were accepted
        assert st["num_spec_steps"] < sum(len(o.token_ids) - 1 for o in spec)


def test_sampled_logprobs_are_the_full_models_under_rejections(tiny_models, drafted):
    path, hf = tiny_models["qwen2"][0], tiny_models["qwen2"][1]
    sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    warpers = transformers.LogitsProcessorList([
        transformers.TemperatureLogitsWarper(0.8), transformers.TopKLogitsWarper(20),
        transformers.TopPLogitsWarper(0.9)])
    (out, unit), st = generate(spec_engine(drafted[2], 2), [req("s", PROMPTS[0], 40, sampling),
                                                            req("u", PROMPTS[2], 30, SamplingParams())])
    assert st["num_accepted_draft_tokens"] < st["num_draft_tokens"]  # rejections happened
    for o, prompt, warp in ((out, PROMPTS[0], warpers), (unit, PROMPTS[2], None)):
        logits = hf_logprobs(hf, prompt, o.token_ids)
        tokens = torch.tensor(o.token_ids)[:, None]
        raw = logits.log_softmax(-1).gather(-1, tokens).squeeze(-1)
        lp = (warp(None, logits.clone()) if warp else logits).log_softmax(-1).gather(-1, tokens).squeeze(-1)
        torch.testing.assert_close(torch.tensor(o.raw_logprobs), raw, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(o.logprobs), lp, atol=1e-4, rtol=0)
    assert path  # the checkpoint drafted[2] copies


# ---- the sampled distribution: a chi-square test over 10,000 draws -----------------------------
V_SMALL, PROMPT_SMALL, NUM_DRAWS = 16, [3, 1, 4, 1, 5], 10_000


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A Qwen2 of 16 tokens whose next-token distributions are spread but far from
    uniform, with K = 2 perturbed MTP modules (drafts often wrong): (checkpoint, HF model)."""
    root = tmp_path_factory.mktemp("small_vocab")
    cfg = transformers.Qwen2Config(vocab_size=V_SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(11)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(6.0)
    model.save_pretrained(root / "base")
    return with_drafts(str(root / "base"), root / "k2", 2, scale=1.0, seed=5), model


def _exact_joint(model, warp) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] of the full model's sampler after PROMPT_SMALL (teacher-forced)."""
    V = V_SMALL
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2]: t1, t2
    seqs = torch.cat([torch.tensor(PROMPT_SMALL).expand(V * V, -1), grid], dim=1)
    with torch.no_grad():
        logits = model(seqs).logits[:, len(PROMPT_SMALL) - 1:].float()  # [V*V, 3, V]
    probs = warp(logits.reshape(-1, V)).softmax(-1).view(V * V, 3, V)
    p1, p2, p3 = probs[0, 0], probs[:: V, 1].reshape(V, V), probs[:, 2].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi2_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Cells expected below 5 pooled into one."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()
    statistic = float(((obs - exp) ** 2 / exp).sum())
    # P(chi2(df) > statistic) = Q(df / 2, statistic / 2), the regularized upper incomplete gamma
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _draws(path: str, sampling: SamplingParams) -> tuple[np.ndarray, dict[str, float]]:
    requests = [req(f"d{i}", PROMPT_SMALL, 3, SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                                                             seed=1000 + i)) for i in range(NUM_DRAWS)]
    outs, st = generate(spec_engine(path, 2, max_num_seqs=256, max_model_len=16), requests)
    return np.array([o.token_ids for o in outs]), st


def _joint_pvalues(draws: np.ndarray, joint: torch.Tensor) -> tuple[float, float]:
    """p-values of the first two tokens' joint frequency and of the second and third's."""
    V, n = V_SMALL, len(draws)
    first = np.bincount(draws[:, 0] * V + draws[:, 1], minlength=V * V)
    later = np.bincount(draws[:, 1] * V + draws[:, 2], minlength=V * V)
    return (_chi2_pvalue(first, n * joint.sum(2).flatten().double().numpy()),
            _chi2_pvalue(later, n * joint.sum(0).flatten().double().numpy()))


SETTINGS = {"t1": (SamplingParams(temperature=1.0), lambda x: x),
            "t07_topk": (SamplingParams(temperature=0.7, top_k=5),
                         lambda x: transformers.TopKLogitsWarper(5)(None, x / 0.7))}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_tokens_follow_the_full_models_distribution(small_vocab, setting):
    path, hf = small_vocab
    sampling, warp = SETTINGS[setting]
    draws, st = _draws(path, sampling)
    # both outcomes are common: a test of the acceptance rule and of the correction draw
    assert 0.2 < st["num_accepted_draft_tokens"] / st["num_draft_tokens"] < 0.8
    p_first, p_later = _joint_pvalues(draws, _exact_joint(hf, warp))
    assert p_first > 1e-3 and p_later > 1e-3, (p_first, p_later)


def test_the_chi_square_test_catches_an_acceptance_rule_that_keeps_every_draft(small_vocab, monkeypatch):
    path, hf = small_vocab
    sampling, warp = SETTINGS["t1"]
    monkeypatch.setattr(spec_sampling, "accepts", lambda u, p, q: torch.ones_like(u, dtype=torch.bool))
    draws, _ = _draws(path, sampling)
    p_first, p_later = _joint_pvalues(draws, _exact_joint(hf, warp))
    assert min(p_first, p_later) < 1e-6, (p_first, p_later)


# ---- stops, lengths, aborts and weight updates ------------------------------------------------
def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(tiny_models, monkeypatch):
    path = tiny_models["qwen2"][0]  # spec-init drafts: long accepted runs
    runs: list[int] = []  # one row at a time: a + 1 tokens a step

    def recording(*args):
        out = real(*args)
        runs.append(int(out.num_accepted[0]) + 1)
        return out

    real = speculative.speculative_sample
    monkeypatch.setattr(speculative, "speculative_sample", recording)
    inside = 0
    for prompt in (PROMPTS[0], PROMPTS[1], PROMPTS[3]):
        runs.clear()
        (full,), _ = generate(spec_engine(path, 3), [req("f", prompt, 24)])
        ends = set(itertools.accumulate([1, *runs]))  # the prefill's token, then each step's run
        stops = list(dict.fromkeys(full.token_ids))  # each token once, at its first place
        requests = [req(f"s{i}", prompt, 24, SamplingParams(temperature=0, stop_token_ids=(stop,)))
                    for i, stop in enumerate(stops)]
        outs, _ = generate(spec_engine(path, 3), requests)
        for stop, out in zip(stops, outs):
            cut = full.token_ids.index(stop) + 1
            assert out.token_ids == full.token_ids[:cut] and out.finish_reason == "stop"
            assert len(out.logprobs) == len(out.raw_logprobs) == len(out.token_versions) == cut
            inside += cut not in ends  # the run it fell in went on past it
    assert inside >= 2


def test_speculation_never_emits_past_max_tokens_or_max_model_len(tiny_models):
    path = tiny_models["qwen2"][0]
    requests = [req(f"m{n}", PROMPTS[0], n) for n in range(1, 9)] + [req("edge", list(range(10)), 50)]
    base, _ = generate(plain_engine(path, max_model_len=16), requests)
    spec, _ = generate(spec_engine(path, 3, max_model_len=16), requests)  # drafts would run past the cache
    for a, b in zip(base, spec):
        assert b.token_ids == a.token_ids and b.finish_reason == "length"
    assert [len(o.token_ids) for o in spec] == [*range(1, 9), 6]


async def _stream_until(engine, request, num_tokens: int, then) -> GenerateOutput:
    """Stream ``request``; once it has ``num_tokens`` tokens, await ``then()`` (gated on an
    event, the stream consumed by a task of its own); its last output."""
    seen: list[GenerateOutput] = []
    reached = asyncio.Event()

    async def consume():
        async for out in engine.stream(request):
            seen.append(out)
            if len(out.token_ids) >= num_tokens:
                reached.set()

    task = asyncio.create_task(consume())
    await reached.wait()
    await then()
    await task
    return seen[-1]


def test_a_weight_update_mid_speculation_leaves_no_stale_draft_state(tiny_models, drafted):
    """After the update the request goes on as a fresh engine on the new weights
    continues it: its drafts (and so its seeded draws) see no KV or hidden state of the
    old weights."""
    path = drafted[2]
    state_b = {k: v.detach().clone() for k, v in tiny_models["qwen2-b"][1].state_dict().items()}
    sampled = SamplingParams(temperature=1.0, seed=3)

    async def crossing(request):
        engine = spec_engine(path, 2)
        await engine.setup()
        try:
            out = await _stream_until(engine, request, 4,
                                      lambda: engine.update_weights(FullWeights(version=1, tensors=state_b)))
            after = await engine.generate(req("after", PROMPTS[0], 12, request.sampling))
            return out, after
        finally:
            await engine.close()

    for sampling in (sampled, GREEDY):
        out, after = loop.run(crossing(req("x", PROMPTS[1], 30, sampling)))
        k = out.token_versions.count(0)
        assert 4 <= k < 30 and out.token_versions == [0] * k + [1] * (30 - k)
        fresh_path = str(Path(path).parent / "fresh_b")
        if not Path(fresh_path).exists():  # the new weights as a checkpoint: MTP modules from the spec init
            tiny_models["qwen2-b"][1].save_pretrained(fresh_path)
        (rest, again), _ = generate(spec_engine(fresh_path, 2), [
            req("x", PROMPTS[1] + out.token_ids[:k], 30 - k, sampling), req("after", PROMPTS[0], 12, sampling)])
        assert out.token_ids[k:] == rest.token_ids
        assert after.token_ids == again.token_ids


def test_an_abort_mid_speculation_leaves_no_stale_draft_state(drafted):
    path = drafted[2]
    sampling = SamplingParams(temperature=1.0, seed=5)

    async def body():
        engine = spec_engine(path, 2, max_num_seqs=1)  # the next request takes the aborted one's slot
        await engine.setup()
        try:
            partial = await _stream_until(engine, req("long", PROMPTS[2], 100), 5, lambda: engine.abort(["long"]))
            return partial, await engine.generate(req("next", PROMPTS[1], 20, sampling))
        finally:
            await engine.close()

    partial, after = loop.run(body())
    (fresh,), _ = generate(spec_engine(path, 2, max_num_seqs=1), [req("next", PROMPTS[1], 20, sampling)])
    assert partial.finish_reason == "abort" and 5 <= len(partial.token_ids) < 100
    assert after.token_ids == fresh.token_ids and after.logprobs == fresh.logprobs


# ---- weights and configuration -----------------------------------------------------------------
def test_the_mtp_weights_are_initialised_as_the_spec_says_and_listed_for_pushes(tiny_models):
    path = tiny_models["qwen2"][0]

    async def body():
        engine = TorchEngine(path, mtp_layers=2)  # speculation off: the modules are held all the same
        await engine.setup()
        try:
            return {k: v.clone() for k, v in engine.named_weights().items()}
        finally:
            await engine.close()

    named = loop.run(body())
    h = named["model.norm.weight"].shape[0]
    for k in range(2):
        p = f"mtp.{k}."
        assert torch.equal(named[p + "eh_proj.weight"], torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1))
        assert torch.equal(named[p + "enorm.weight"], torch.ones(h)) and torch.equal(named[p + "hnorm.weight"],
                                                                                     torch.ones(h))
        assert torch.equal(named[p + "norm.weight"], named["model.norm.weight"])
        assert torch.equal(named[p + "layer.mlp.down_proj.weight"], named["model.layers.1.mlp.down_proj.weight"])
        assert torch.equal(named[p + "layer.self_attn.q_proj.bias"], named["model.layers.1.self_attn.q_proj.bias"])


def test_checkpoint_mtp_weights_load_are_skipped_without_modules_and_too_many_is_an_error(drafted):
    path = drafted[2]
    cfg = ModelConfig.from_dir(path)
    store = WeightStore(cfg, torch.device("cpu"), torch.float32, mtp_layers=2)
    store.load_dir(path)
    from safetensors.torch import load_file
    saved = load_file(str(Path(path) / "mtp.safetensors"))
    assert all(torch.equal(store.params[n], t) for n, t in saved.items())
    WeightStore(cfg, torch.device("cpu"), torch.float32).load_dir(path)  # mtp_layers 0: skipped
    one = WeightStore(cfg, torch.device("cpu"), torch.float32, mtp_layers=1)
    with pytest.raises(ValueError, match=r"has 2 MTP modules \(mtp\.\*\), more than model\.mtp_layers=1$"):
        one.load_dir(path)
    three = WeightStore(cfg, torch.device("cpu"), torch.float32, mtp_layers=3)
    three.load_dir(path)  # the third module is initialised, the first two loaded
    assert torch.equal(three.params["mtp.1.eh_proj.weight"], saved["mtp.1.eh_proj.weight"])
    assert torch.equal(three.params["mtp.2.norm.weight"], three.params["model.norm.weight"])


def test_speculation_needs_mtp_modules_and_the_torch_engine(tiny_models):
    path = tiny_models["qwen2"][0]
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.speculative: 'mtp' drafts with the MTP modules"):
        load_config(None, ["rollout.engine.speculative=mtp"])
    load_config(None, ["rollout.engine.speculative=mtp", "model.mtp_layers=2"])
    with pytest.raises(ValueError, match=r"^speculative must be 'off' unless type is 'torch' \(type is 'vllm'\)$"):
        EngineConfig(type="vllm", speculative="mtp")
    with pytest.raises(ValueError, match=r"needs model\.mtp_layers > 0$"):
        make_engine(EngineConfig(speculative="mtp"), path, seed=0)
    engine = make_engine(EngineConfig(speculative="mtp"), path, seed=0, mtp_layers=2)
    assert (engine._mtp_layers, engine._speculative) == (2, True)
    with pytest.raises(ValueError, match=r"^rollout\.engine\.type: 'tests\.test_engine_speculative:no_mtp' "
                                         r"does not take model\.mtp_layers"):
        make_engine(EngineConfig(type="tests.test_engine_speculative:no_mtp"), path, seed=0, mtp_layers=1)


def no_mtp(cfg, model_path, *, seed):
    """An engine factory that does not take ``mtp_layers``."""
    return TorchEngine(model_path, seed=seed)


# ---- the engine contract, speculating --------------------------------------------------------
class TestSpeculativeEngineContract(EngineContract):
    @pytest.fixture
    def engine_factory(self):
        return lambda model_dir, **options: spec_engine(model_dir, 2, **options)


def test_the_benchmark_smoke_run_prints_its_keys(capsys):
    from bench import speculative as bench_speculative

    result = bench_speculative.main(["--smoke"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == result and printed["mtp_layers"] == 2 and printed["bench"] == "speculative"
    (run,) = printed["runs"]
    assert {"batch", "off", "mtp", "speedup", "acceptance_rate", "mean_tokens_per_spec_step"} <= set(run)
    for mode in ("off", "mtp"):
        assert {"tokens_per_s", "decode_tokens_per_s", "num_tokens", "num_spec_steps"} <= set(run[mode])
    assert run["off"]["num_spec_steps"] == 0 < run["mtp"]["num_spec_steps"]
    assert 0 <= run["acceptance_rate"] <= 1


def test_speculation_over_fp8_linears_samples_the_fp8_models_greedy_tokens(drafted):
    """FP8 rollout and MTP drafts together (the FP8 GEMM's reference path on the CPU): the
    verify forward runs the FP8 linears, so greedy speculation gives the FP8 engine's tokens."""
    fp8 = {"weight_dtype": "fp8", "fp8_reference_for_tests": True, "max_num_seqs": 2}
    requests = [req(f"r{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS[:2], (9, 23)))]
    base, _ = generate(plain_engine(drafted[2], mtp_layers=2, **fp8), requests)
    spec, st = generate(spec_engine(drafted[2], 2, **fp8), requests)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    for a, b in zip(base, spec):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    assert st["num_spec_steps"] > 0 and st["fp8_kernel"] == "reference"


def test_a_run_with_mtp_drafts_trains_the_modules_and_reports_the_acceptance(tmp_path):
    """End to end, local runtime: the trainer trains the modules (``train/mtp/acc_0`` in every step's
    record), every push carries them to the engine, which drafts with them; ``run.check()`` gives
    the engines' acceptance rate, and each step's record the share accepted since the last step."""
    from actors.launch import launch

    root = Path(__file__).resolve().parents[1]
    with launch(root / "fully_async.yaml", "model.mtp_layers=1", "rollout.engine.speculative=mtp",
                "trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8", "run.progress=false",
                f"run.output_dir={tmp_path}") as run:
        result = run.train(steps=4)
        counters = run.check()
    assert len(result) == 4 and all("train/mtp/acc_0" in record for record in result)
    assert 0.0 <= counters["spec_acceptance"] <= 1.0
    rates = [record["spec/acceptance"] for record in result if "spec/acceptance" in record]
    assert rates and all(0.0 <= rate <= 1.0 for rate in rates)
    assert 0.0 <= result[-1]["spec/acceptance_total"] <= 1.0
