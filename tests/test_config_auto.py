"""The ``auto`` values (``trainer.dtype``, ``trainer.kernels``, ``trainer.cuda_graphs``,
``rollout.engine.dtype``, ``rollout.engine.max_num_seqs``) are resolved once, when the
config is read: the fast settings on CUDA, the safe ones on a CPU, a value given kept as
given. No GPU is needed: resolving reads the config, not the device (liger-kernel's
presence and the varlen attention are patched to make both cases)."""

from __future__ import annotations

import pathlib

import pytest
import torch
import yaml

import actors.backends.config
import actors.backends.kernels
import actors.config
from actors.backends.config import TrainerConfig
from actors.config import load_config, load_resume_config, to_yaml
from actors.engines.config import CPU_MAX_NUM_SEQS, CUDA_MAX_NUM_SEQS, EngineConfig
from actors.engines.kv_cache import KVCache, slots_that_fit
from actors.engines.torch_engine import TorchEngine
from actors.models import BUILTIN_MODEL_DIR

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA = ["trainer.device=cuda", "rollout.engine.device=cuda"]


@pytest.fixture
def liger(monkeypatch: pytest.MonkeyPatch):
    """``liger(True)``: liger-kernel imports here; ``liger(False)``: it does not (the varlen
    attention is there either way, so that this torch's version does not decide)."""
    monkeypatch.setattr(actors.backends.config, "_varlen_available", lambda: True)

    def installed(yes: bool) -> None:
        def unavailable(kernels: str, device: str | None) -> str | None:
            return None if yes or kernels == "eager" else "'liger' needs liger-kernel, which is not installed"

        for module in (actors.backends.kernels, actors.config):  # the resolution's and the load check's
            monkeypatch.setattr(module, "kernels_unavailable", unavailable)

    return installed


def test_a_cpu_config_resolves_auto_to_float32_eager_no_graphs_and_128_sequences():
    cfg = load_config(None)
    t, e = cfg.trainer, cfg.rollout.engine
    assert (t.dtype, t.kernels, t.cuda_graphs) == ("float32", "eager", False)
    assert (e.dtype, e.max_num_seqs) == ("float32", CPU_MAX_NUM_SEQS) == ("float32", 128)
    saved = yaml.safe_load(to_yaml(cfg))  # what the run directory keeps
    assert (saved["trainer"]["dtype"], saved["trainer"]["kernels"], saved["trainer"]["cuda_graphs"]) == (
        "float32", "eager", False)
    assert (saved["rollout"]["engine"]["dtype"], saved["rollout"]["engine"]["max_num_seqs"]) == ("float32", 128)


@pytest.mark.parametrize("installed", [True, False])
def test_a_cuda_config_resolves_auto_to_bf16_graphs_and_liger_only_where_it_imports(liger, installed):
    liger(installed)
    cfg = load_config(None, CUDA)
    t, e = cfg.trainer, cfg.rollout.engine
    assert (t.dtype, t.cuda_graphs, t.kernels) == ("bfloat16", True, "liger" if installed else "eager")
    assert (e.dtype, e.max_num_seqs) == ("bfloat16", None)  # the built-in engine sizes it at setup


def test_each_section_resolves_its_dtype_by_its_own_device(liger):
    liger(False)
    cfg = load_config(None, ["trainer.device=cuda:1"])
    assert (cfg.trainer.dtype, cfg.rollout.engine.dtype, cfg.rollout.engine.max_num_seqs) == (
        "bfloat16", "float32", 128)
    cfg = load_config(None, ["rollout.engine.device=cuda"])
    assert (cfg.trainer.dtype, cfg.trainer.cuda_graphs, cfg.rollout.engine.dtype) == ("float32", False, "bfloat16")


@pytest.mark.parametrize(("overrides", "want"), [
    (["trainer.cuda_graphs=false"], {"cuda_graphs": False, "dtype": "bfloat16", "kernels": "liger"}),
    (["trainer.dtype=float32"], {"dtype": "float32", "cuda_graphs": False}),
    (["trainer.kernels=eager"], {"kernels": "eager", "cuda_graphs": True}),
    (["trainer.compile=true"], {"kernels": "eager", "cuda_graphs": False}),
    (["trainer.activation_checkpointing=true"], {"cuda_graphs": False, "kernels": "liger"}),
    (["trainer.packed=false"], {"cuda_graphs": False}),
    (["trainer.num_workers=2", "runtime.type=process", "sync.mode=delta"], {"cuda_graphs": False}),
    (["trainer.cuda_graphs=true", "trainer.dtype=auto"], {"cuda_graphs": True, "dtype": "bfloat16"}),
])
def test_a_value_the_user_gives_is_kept_and_the_autos_beside_it_follow(liger, overrides, want):
    liger(True)
    t = load_config(None, [*CUDA, *overrides]).trainer
    assert {k: getattr(t, k) for k in want} == want


def test_an_engine_value_the_user_gives_is_kept(liger):
    liger(True)
    e = load_config(None, [*CUDA, "rollout.engine.dtype=float16", "rollout.engine.max_num_seqs=64"]).rollout.engine
    assert (e.dtype, e.max_num_seqs) == ("float16", 64)


def test_auto_graphs_need_the_varlen_attention_and_kernels_the_torch_backend(monkeypatch):
    monkeypatch.setattr(actors.backends.config, "_varlen_available", lambda: False)
    assert TrainerConfig(device="cuda").cuda_graphs is False
    megatron = TrainerConfig(backend="megatron", device="cuda")  # the section alone: megatron-core is not here
    assert (megatron.dtype, megatron.kernels, megatron.cuda_graphs) == ("bfloat16", "eager", False)


def test_vllm_and_sglang_get_a_fixed_batch_the_built_in_engine_sizes_its_own():
    assert EngineConfig(type="vllm", device="cuda").max_num_seqs == CUDA_MAX_NUM_SEQS == 256
    assert EngineConfig(type="sglang", device="cpu", url="http://127.0.0.1:30000").max_num_seqs == 128
    assert EngineConfig(device="cuda").max_num_seqs is None
    assert TorchEngine(str(BUILTIN_MODEL_DIR), max_num_seqs=None).max_num_seqs == CPU_MAX_NUM_SEQS  # a CPU


def test_the_engine_sizes_its_batch_by_the_kv_cache_bytes_it_allocates():
    kv = KVCache(num_layers=3, num_slots=5, num_kv_heads=2, max_len=32, head_dim=8, device=torch.device("cpu"),
                 dtype=torch.bfloat16)
    shape = dict(num_layers=3, num_kv_heads=2, max_len=32, head_dim=8, dtype=torch.bfloat16)
    assert slots_that_fit(kv.nbytes, **shape, most=256) == 5
    assert slots_that_fit(kv.nbytes - 1, **shape, most=256) == 4
    assert slots_that_fit(0, **shape, most=256) == 1  # never below one sequence
    assert slots_that_fit(1 << 50, **shape, most=256) == 256


def test_the_saved_config_resumes_with_the_resolved_values(liger, tmp_path):
    liger(True)
    cfg = load_config(None, CUDA)
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    tree = yaml.safe_load(saved.read_text())
    assert {k: tree["trainer"][k] for k in ("dtype", "kernels", "cuda_graphs")} == {
        "dtype": "bfloat16", "kernels": "liger", "cuda_graphs": True}
    assert (tree["rollout"]["engine"]["dtype"], tree["rollout"]["engine"]["max_num_seqs"]) == ("bfloat16", None)
    again = load_resume_config(saved, ["run.total_steps=7"])
    assert again.trainer == cfg.trainer and again.rollout == cfg.rollout and again.run.total_steps == 7
    liger(False)  # resumed where liger-kernel is gone: the saved choice is kept (so refused), and may be changed
    with pytest.raises(actors.config.ConfigError, match="^trainer.kernels: 'liger' needs liger-kernel"):
        load_resume_config(saved)
    assert load_resume_config(saved, ["trainer.kernels=eager"]).trainer.kernels == "eager"
    with pytest.raises(actors.config.ConfigError, match="^rollout.engine.dtype: cannot change when resuming"):
        load_resume_config(saved, ["trainer.kernels=eager", "rollout.engine.dtype=float32"])


def test_the_smollm2_gpu_example_loads_and_resolves_the_fast_settings_without_a_gpu(liger):
    liger(True)
    cfg = load_config(ROOT / "examples" / "smollm2_gpu.yaml")
    t, e = cfg.trainer, cfg.rollout.engine
    assert (t.device, t.dtype, t.cuda_graphs, t.kernels) == ("cuda", "bfloat16", True, "liger")
    assert (e.device, e.dtype, e.max_num_seqs) == ("cuda", "bfloat16", None)
    assert cfg.rollout.max_response_tokens + 62 <= e.max_model_len  # SmolLM2's rendered prompts: 60-62 tokens
    assert (cfg.runtime.type, cfg.run.name, cfg.run.total_steps) == ("process", "smollm2_gpu", 150)
