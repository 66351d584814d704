"""trainer.compile: the torch backend with each decoder layer torch.compile-d computes what the eager
backend computes (fp32: log-probs within 1e-5, one step's grads and weights within 1e-5), compiles
once whatever the batch lengths, and is refused where it does not apply.

Inductor compiles C++ here (it needs a compiler): a test takes seconds once inductor's on-disk cache
holds its graphs, tens of seconds the first time on a small shared machine. Dynamo's in-memory caches
are reset before each test, so each counts its own compilations and none falls back to eager for
hitting dynamo's recompile limit (8 per code object, and every HF layer shares one). The packed path
(the default) runs by default; padded, bf16 and activation checkpointing are marked slow (about
20-35 s each from a cold cache).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from actors.backends import TrainerConfig, make_backend
from actors.backends.batching import micro_batches
from actors.backends.compile import _attention_op
from actors.backends.torch_backend import TorchBackend
from actors.config import ConfigError, load_config
from contracts.sample import Sample
from policies.losses import make_loss
from tests.helpers import llama_dirs, samples_for

_CXX = next((c for c in (os.environ.get("CXX"), "g++", "clang++") if c and shutil.which(c)), None)
pytestmark = pytest.mark.skipif(_CXX is None, reason="torch.compile (inductor) on a CPU needs a C++ compiler: "
                                                     "no $CXX, g++ or clang++ on PATH")
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama (its own lm_head) in fp32 and in bf16."""
    return llama_dirs(tmp_path_factory.mktemp("compile_models"))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _backend(path: str, compile: bool, **kw) -> TorchBackend:
    b = TorchBackend(path, loss=make_loss("ppo_clip"), lr=kw.pop("lr", 1e-4), seed=0, compile=compile, **kw)
    b.setup()
    return b


def _samples(backend: TorchBackend, seed: int = 0, num: int = 6) -> list[Sample]:
    """Samples of different lengths, behaviour log-probs a little off the backend's."""
    samples = samples_for(backend.model.config.vocab_size, seed=seed, num=num)
    for s, lps in zip(samples, backend.compute_logprobs(samples)):
        s.rollout_logprobs = [lp - 0.05 for lp in lps]
    return samples


def _tokens(samples: list[Sample]) -> int:
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)


def _assert_compiled_whole() -> None:
    """Something compiled, and no graph broke (the packed attention is an op inside the layer's graph)."""
    assert counters["stats"]["unique_graphs"] > 0
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("packed", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_compiled_logprobs_equal_eager_logprobs(model_dirs, packed):
    compiled, eager = _backend(model_dirs["float32"], True, packed=packed), _backend(model_dirs["float32"], False,
                                                                                   packed=packed)
    assert compiled.packed is packed and compiled.padded_reason is None
    samples = samples_for(compiled.model.config.vocab_size)
    got, want = compiled.compute_logprobs(samples), eager.compute_logprobs(samples)
    _assert_compiled_whole()
    assert compiled.compiled_graphs > 0 and compiled.compile_s > 0 and eager.compiled_graphs == 0
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)


@pytest.mark.parametrize(("packed", "micro_batch_tokens", "checkpointing"),
                         [(True, 24, False), pytest.param(False, 0, False, marks=pytest.mark.slow),
                          pytest.param(True, 0, True, marks=pytest.mark.slow)])
def test_one_compiled_train_step_leaves_the_weights_of_the_eager_step(model_dirs, packed, micro_batch_tokens,
                                                                      checkpointing):
    """fp32: metrics within 1e-5 (relative), grads (clipped, as stepped) within 1e-5, weights within
    1e-5 wherever the grad exceeds 1e-6. AdamW's first step moves a weight by lr * g / (|g| + 1e-8),
    so where g is near 1e-8 a difference of 1e-8 in it (seen: padded, one element) moves the weight
    by up to lr = 1e-4 either way."""
    runs = []
    for compile in (True, False):
        b = _backend(model_dirs["float32"], compile, packed=packed, micro_batch_tokens=micro_batch_tokens,
                     activation_checkpointing=checkpointing, logprob_chunk_tokens=4)
        samples = _samples(b)
        metrics = b.train_step(samples, ADVANTAGES)
        grads = {n: p.grad.clone() for n, p in b.model.named_parameters()}
        runs.append((metrics, grads, {n: t.clone() for n, t in b.named_weights().items()}))
    _assert_compiled_whole()
    if micro_batch_tokens:
        assert len(micro_batches(samples, micro_batch_tokens, packed=packed)) > 1
    (m_compiled, g_compiled, w_compiled), (m_eager, g_eager, w_eager) = runs
    assert m_compiled["compiled_graphs"] > 0 and "compiled_graphs" not in m_eager
    for key in ("loss", "entropy", "ratio_mean", "grad_norm", "tokens"):
        assert m_compiled[key] == pytest.approx(m_eager[key], rel=1e-5, abs=1e-6), key
    for name in g_eager:
        torch.testing.assert_close(g_compiled[name], g_eager[name], atol=1e-5, rtol=0, msg=name)
    assert w_compiled.keys() == w_eager.keys()
    num_firm = 0
    for name in g_eager:
        firm = g_eager[name].abs() > 1e-6
        torch.testing.assert_close(w_compiled[name][firm], w_eager[name][firm], atol=1e-5, rtol=0, msg=name)
        num_firm += int(firm.sum())
    assert num_firm > 0.8 * sum(g.numel() for g in g_eager.values())


@pytest.mark.parametrize("packed", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_new_batch_lengths_after_warm_up_compile_nothing(model_dirs, packed):
    """Warm-up (a compute_logprobs and a train_step) compiles 4 graphs: the layer and the final norm,
    each without and with gradients; then batches of other lengths and sizes reuse them."""
    b = make_backend(TrainerConfig(compile=True, packed=packed, lr=1e-4), model_dirs["float32"], seed=0,
                     loss=make_loss("ppo_clip"))
    b.setup()
    samples = _samples(b)
    metrics = b.train_step(samples, ADVANTAGES)
    assert b.compiled_graphs == 4 and metrics["compiled_graphs"] == 4.0
    assert metrics["compile_s"] == b.compile_s > 0
    graphs, lengths = counters["stats"]["unique_graphs"], {_tokens(samples)}
    for seed, num in ((1, 3), (2, 8), (3, 5), (4, 2)):  # other lengths, other sequence counts
        samples = _samples(b, seed=seed, num=num)
        lengths.add(_tokens(samples))
        b.train_step(samples, [(-1.0) ** i for i in range(num)])
    assert len(lengths) == 5
    assert b.compiled_graphs == 4 and counters["stats"]["unique_graphs"] == graphs
    _assert_compiled_whole()


@pytest.mark.slow
def test_a_bf16_model_with_fp32_main_params_compiles_within_bf16_rounding(model_dirs):
    """bf16: the compiled layers round differently from eager (fused, fp32 inside a kernel), so
    their log-probs sit at least as close to the fp32 model's as eager's do; the step runs with
    fp32 main params, which the model holds rounded to bf16."""
    compiled = _backend(model_dirs["bfloat16"], True, dtype="bfloat16", master_dtype="float32")
    eager = _backend(model_dirs["bfloat16"], False, dtype="bfloat16", master_dtype="float32")
    reference = _backend(model_dirs["bfloat16"], False, dtype="float32")
    samples = samples_for(compiled.model.config.vocab_size)
    want = torch.tensor([x for row in reference.compute_logprobs(samples) for x in row])
    errors = {}
    for name, b in (("compiled", compiled), ("eager", eager)):
        got = torch.tensor([x for row in b.compute_logprobs(samples) for x in row])
        errors[name] = (got - want).abs()
    assert errors["compiled"].max() <= 1.5 * errors["eager"].max() + 1e-3, errors
    assert errors["compiled"].mean() <= 1.5 * errors["eager"].mean() + 1e-3, errors
    before = compiled.named_weights(dtype=torch.float32)
    for s, lps in zip(samples, compiled.compute_logprobs(samples)):
        s.rollout_logprobs = lps
    metrics = compiled.train_step(samples, ADVANTAGES)
    _assert_compiled_whole()
    assert metrics["grad_norm"] > 0 and compiled.model.dtype == torch.bfloat16
    for (name, p), main in zip(compiled.model.named_parameters(), compiled.optimizer.main):
        assert main.dtype == torch.float32 and torch.equal(p, main.to(torch.bfloat16)), name
    assert not torch.equal(before["model.embed_tokens.weight"], compiled.named_weights(dtype=torch.float32)
                           ["model.embed_tokens.weight"])


def test_the_packed_attention_op_passes_torch_library_opcheck():
    """Its fake (shapes and strides), its autograd and its schema agree with what it computes."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 11, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    bounds = torch.tensor([0, 4, 11])
    torch.library.opcheck(_attention_op, (q, k, v, bounds.to(torch.int32), bounds, 8**-0.5))


def test_setup_refuses_compile_over_several_data_parallel_ranks(model_dirs, monkeypatch):
    from actors.backends import torch_backend

    monkeypatch.setattr(torch_backend.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_backend.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch_backend.dist, "get_rank", lambda group=None: 0)
    backend = TorchBackend(model_dirs["float32"], loss=make_loss("ppo_clip"), compile=True)
    with pytest.raises(ValueError, match=r"^trainer\.compile: not with 2 data-parallel ranks \(FSDP2\)"):
        backend.setup()
    assert backend.model is None  # refused before loading anything


@pytest.mark.parametrize(("overrides", "line"), [
    (["trainer.compile=true", "trainer.backend=megatron", "trainer.device=cuda"],
     "trainer.compile: must be false with backend 'megatron'"),
    (["trainer.compile=true", "trainer.num_workers=2", "runtime.type=process", "sync.mode=full"],
     "trainer.compile: must be false with num_workers=2"),
])
def test_compile_is_refused_at_load_where_it_does_not_apply(overrides, line):
    with pytest.raises(ConfigError, match="^" + line.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, overrides)
    assert load_config(None, ["trainer.compile=true"]).trainer.compile
    with pytest.raises(ValueError, match="^compile must be false with backend 'megatron'"):
        TrainerConfig(backend="megatron", compile=True)
