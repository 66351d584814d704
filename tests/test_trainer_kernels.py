"""trainer.kernels=liger: the torch backend with Liger-Kernel's fused RMSNorm / SwiGLU / RoPE computes
what eager computes (fp32: log-probs, one step's grads and weights within 1e-5; bf16: log-probs at least
as close to the fp32 model's as eager's), and is refused, in one line, where it cannot run. The
kernels are Triton: their tests need a CUDA device and liger-kernel (marked ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from actors.backends import TrainerConfig, make_backend
from actors.backends.torch_backend import TorchBackend
from actors.config import ConfigError, load_config
from policies.losses import make_loss
from tests.helpers import llama_dirs, samples_for

ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]


@pytest.mark.parametrize(("overrides", "line"), [
    (["trainer.kernels=liger"], "trainer.kernels: 'liger' runs Triton kernels, which need trainer.device=cuda "
                                "(got 'cpu')"),
    (["trainer.kernels=liger", "trainer.backend=megatron", "trainer.device=cuda"],
     "trainer.kernels: must be eager with backend 'megatron'"),
    (["trainer.kernels=liger", "trainer.compile=true", "trainer.device=cuda"],
     "trainer.kernels: must be eager with compile true (dynamo cannot trace liger's kernels here); choose one"),
    (["trainer.kernels=fused"], "trainer.kernels: invalid enum value 'fused' (expected one of: auto, eager, liger)"),
])
def test_kernels_are_refused_at_load_where_they_cannot_run(overrides, line):
    with pytest.raises(ConfigError, match="^" + line.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)
    assert load_config(None, []).trainer.kernels == "eager"


def test_a_missing_liger_kernel_is_named_with_its_extra(monkeypatch, tmp_path):
    from actors.backends import config

    monkeypatch.setattr(config, "import_error", lambda module: "is not installed")
    with pytest.raises(ValueError, match=r"^trainer\.kernels: 'liger' needs liger-kernel, which is not installed; "
                                         r"install the optional extra: pip install -e \"\.\[liger\]\"$"):
        make_backend(TrainerConfig(kernels="liger", device="cuda"), str(tmp_path), seed=0, loss=make_loss("ppo_clip"))


def test_the_backend_names_an_unknown_kernels_value(tmp_path):
    with pytest.raises(ValueError, match=r"^kernels must be one of \['eager', 'liger'\], got 'fused'$"):
        TorchBackend(str(tmp_path), loss=make_loss("ppo_clip"), kernels="fused")


def _needs_liger() -> None:
    if not torch.cuda.is_available():
        pytest.skip("Liger's Triton kernels need a CUDA device")
    pytest.importorskip("liger_kernel.transformers")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return llama_dirs(tmp_path_factory.mktemp("kernel_models"))


def _backend(path: str, kernels: str, **kw) -> TorchBackend:
    b = TorchBackend(path, loss=make_loss("ppo_clip"), lr=1e-4, seed=0, device="cuda", kernels=kernels, **kw)
    b.setup()
    return b


@pytest.mark.gpu
def test_liger_logprobs_and_one_step_equal_eager_in_fp32(model_dirs):
    _needs_liger()
    runs, backends = [], []
    for kernels in ("liger", "eager"):  # liger first: the eager model built after it must stay eager
        b = _backend(model_dirs["float32"], kernels, logprob_chunk_tokens=4)
        backends.append(b)
        samples = samples_for(b.model.config.vocab_size)
        lps = b.compute_logprobs(samples)
        for s, row in zip(samples, lps):
            s.rollout_logprobs = [lp - 0.05 for lp in row]
        metrics = b.train_step(samples, ADVANTAGES)
        grads = {n: p.grad.clone() for n, p in b.model.named_parameters()}
        runs.append((lps, metrics, grads, b.named_weights()))
    (lps_l, m_l, g_l, w_l), (lps_e, m_e, g_e, w_e) = runs
    for b, fused in zip(backends, (True, False)):
        for module in (b.model.model.norm, b.model.model.layers[0].mlp):
            assert (module.forward.__func__ is not type(module).forward) is fused, (b.kernels, module)
    for got, want in zip(lps_l, lps_e):
        assert got == pytest.approx(want, abs=1e-5)
    for key in ("loss", "entropy", "ratio_mean", "grad_norm"):
        assert m_l[key] == pytest.approx(m_e[key], rel=1e-5, abs=1e-6), key
    for name in g_e:
        torch.testing.assert_close(g_l[name], g_e[name], atol=1e-5, rtol=0, msg=name)
        firm = g_e[name].abs() > 1e-6  # where |g| ~ 1e-8, AdamW's first step moves a weight by up to lr either way
        torch.testing.assert_close(w_l[name][firm], w_e[name][firm], atol=1e-5, rtol=0, msg=name)


@pytest.mark.gpu
def test_liger_bf16_logprobs_sit_as_close_to_fp32_as_eager(model_dirs):
    _needs_liger()
    reference = _backend(model_dirs["bfloat16"], "eager", dtype="float32")
    samples = samples_for(reference.model.config.vocab_size)
    want = torch.tensor([x for row in reference.compute_logprobs(samples) for x in row])
    errors = {}
    for kernels in ("liger", "eager"):
        b = _backend(model_dirs["bfloat16"], kernels, dtype="bfloat16", master_dtype="float32")
        errors[kernels] = (torch.tensor([x for row in b.compute_logprobs(samples) for x in row]) - want).abs()
    assert errors["liger"].max() <= 1.5 * errors["eager"].max() + 1e-3, errors
    assert errors["liger"].mean() <= 1.5 * errors["eager"].mean() + 1e-3, errors
