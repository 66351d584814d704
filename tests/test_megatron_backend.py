"""The Megatron-core backend: its HF <-> Megatron weight maps (CPU, always), the
real megatron-core modules run on CPU with the maps (where megatron-core is
installed), and the backend on a GPU against the torch backend (``gpu`` marker).

GPU tests (TP 1; TP 2 only with two GPUs) are self-contained: each builds a
small Qwen2 / Llama checkpoint of its own with transformers, and they run in one
process (torch.distributed and Megatron's parallel state are initialised once,
world size 1, by the first backend's setup).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import socket

import pytest
import torch
import transformers

from actors.backends import TrainerConfig, make_backend
from actors.backends import megatron_convert as mc
from actors.backends.torch_backend import TorchBackend
from contracts.sample import Sample
from policies.losses import make_loss
from tests.extras import installed, needs_mark

PPO = make_loss("ppo_clip")
HAVE_MEGATRON = installed("megatron.core")
needs_megatron = needs_mark("megatron.core", "megatron")


# -- tiny models ------------------------------------------------------------------------


def hf_config(kind: str, **over) -> transformers.PretrainedConfig:
    """A tiny GQA model (4 query heads, 2 key/value heads): Qwen2 with qkv biases and a
    tied head, or Llama with its own lm_head. The vocabulary (37) is odd, so TP 2 pads it;
    initializer_range 0.2 keeps the logits far from uniform."""
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=37, max_position_embeddings=64,
                  rms_norm_eps=1e-6, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "qwen2":
        return transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, "rope_theta": 1e6, **over})
    assert kind == "llama"
    return transformers.LlamaConfig(**{**common, "tie_word_embeddings": False, "rope_theta": 5e5, **over})


def hf_model(kind: str, seed: int = 0, **over) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **over))
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so a layout slip shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def save_model(kind: str, path: pathlib.Path, dtype: torch.dtype = torch.float32) -> pathlib.Path:
    hf_model(kind).to(dtype).save_pretrained(path, safe_serialization=True)
    return path


def samples_for(vocab: int, seed: int = 0, num: int = 6) -> list[Sample]:
    """Three groups of two responses, prompts and responses of different lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        p, n = 3 + (i * 5) % 9, 2 + (i * 3) % 7
        ids = torch.randint(3, vocab, (p + n,), generator=g).tolist()
        out.append(Sample(uid=f"s{i}", group_id=f"g{i // 2}", prompt_ids=[1, *ids[:p]], response_ids=ids[p:]))
    return out


# -- the layout maps (CPU, pure torch) ------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_hf_to_megatron_to_hf_is_exact_for_a_gqa_model(kind):
    model = hf_model(kind)
    hf = model.state_dict()
    shape = mc.GptShape.from_hf_config(model.config)
    assert (shape.num_heads, shape.num_query_groups, shape.qkv_bias, shape.tied) == (4, 2, kind == "qwen2", kind == "qwen2")
    meg = mc.hf_to_megatron(hf, shape)
    assert list(meg) == mc.megatron_names(shape)
    qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 16, 64)  # ng * (nh/ng + 2) * d rows
    back = mc.megatron_to_hf(meg, shape)
    assert list(back) == list(hf)  # the HF state_dict's names, in its order (lm_head too when tied)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    if shape.tied:
        assert back["lm_head.weight"] is back["model.embed_tokens.weight"]
    saved = mc.megatron_to_hf(meg, shape, include_tied=False)
    assert ("lm_head.weight" in saved) == (not shape.tied)


def test_fused_qkv_holds_each_query_groups_q_heads_then_its_k_head_then_its_v_head():
    """Megatron's layout (SelfAttention.get_query_key_value_tensors views linear_qkv's output
    as [sq, b, ng, (np/ng + 2) * hn] and splits it [np/ng * hn, hn, hn]): every row is labelled
    here with (kind, head), and the fused order is spelled out by hand."""
    nh, ng, d = 6, 2, 3
    def labelled(kind: int, heads: int) -> torch.Tensor:  # row r of head h: [kind, h, r]
        return torch.tensor([[kind, h, r] for h in range(heads) for r in range(d)], dtype=torch.float32)
    q, k, v = labelled(0, nh), labelled(1, ng), labelled(2, ng)
    fused = mc.fuse_qkv(q, k, v, num_query_groups=ng)
    expected = [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0),   # group 0: q heads 0-2 (HF's repeat_kv: h // 3 == 0), k0, v0
                (0, 3), (0, 4), (0, 5), (1, 1), (2, 1)]   # group 1: q heads 3-5, k1, v1
    got = [(int(fused[i * d, 0]), int(fused[i * d, 1])) for i in range(len(expected))]
    assert got == expected
    assert all(fused[i * d + r, 2] == r for i in range(len(expected)) for r in range(d))  # heads stay whole
    # and Megatron's own split of it, as attention.py does it, gives the HF heads back
    per_group = fused.view(ng, (nh // ng + 2) * d, 3)
    mq, mk, mv = torch.split(per_group, [nh // ng * d, d, d], dim=1)
    assert torch.equal(mq.reshape(-1, 3), q) and torch.equal(mk.reshape(-1, 3), k) and torch.equal(mv.reshape(-1, 3), v)
    assert all(torch.equal(a, b) for a, b in zip(mc.split_qkv(fused, ng, nh, d), (q, k, v)))
    # biases ([rows]) fuse the same way
    assert torch.equal(mc.fuse_qkv(q[:, 1], k[:, 1], v[:, 1], ng), fused[:, 1])


def test_fused_fc1_is_gate_rows_then_up_rows():
    """The local MLP's glu: ``torch.chunk(fc1_out, 2, dim=-1)``, silu on the first half (gate)."""
    gate, up = torch.full((5, 2), 1.0), torch.full((5, 2), 2.0)
    fc1 = mc.fuse_gate_up(gate, up)
    first, second = torch.chunk(fc1, 2, dim=0)
    assert torch.equal(first, gate) and torch.equal(second, up)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_tensor_parallel_slices_of_two_ranks_assemble_every_hf_tensor(kind):
    """Each rank's local Megatron tensors give contiguous HF slices; together they tile each
    HF tensor exactly once (norms: whole on each rank); the padded vocabulary row is dropped."""
    model = hf_model(kind)
    hf, shape = model.state_dict(), mc.GptShape.from_hf_config(model.config)
    full = mc.hf_to_megatron(hf, shape)
    tp = 2
    assert shape.padded_vocab_size(tp) == 38
    locals_ = [{n: mc.tp_shard(n, t, shape, r, tp) for n, t in full.items()} for r in range(tp)]
    assert locals_[1]["embedding.word_embeddings.weight"][-1].abs().sum() == 0  # the padding row
    for name in full:  # shard -> unshard is the identity
        assert torch.equal(mc.tp_unshard(name, [loc[name] for loc in locals_], shape), full[name]), name
    shapes = mc.hf_full_shapes(shape)
    assembled = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
    for r in range(tp):
        for name, part in mc.megatron_to_hf_local(locals_[r], shape, tp_rank=r, tp_size=tp).items():
            if mc.hf_is_replicated(name):
                assert torch.equal(part.tensor, hf[name]) and part.offset == 0
                assembled[name] = part.tensor.clone()
                continue
            target = assembled[name].narrow(part.dim, part.offset, part.tensor.shape[part.dim])
            assert torch.isnan(target).all(), f"{name}: rank {r} overlaps another rank's slice"
            target.copy_(part.tensor)
    for name, t in hf.items():
        assert torch.equal(assembled[name], t), name


def test_hf_parameter_order_is_the_hf_models():
    """Optimizer state travels in the HF model's ``parameters()`` order (the torch backend's)."""
    for kind in ("qwen2", "llama"):
        model = hf_model(kind)
        shape = mc.GptShape.from_hf_config(model.config)
        names = [n for n in mc.hf_full_shapes(shape) if not (shape.tied and n == "lm_head.weight")]
        assert names == [n for n, _ in model.named_parameters()]


def test_unsupported_models_are_refused_naming_what():
    with pytest.raises(ValueError, match="model types llama, qwen2; this model is 'gpt2'"):
        mc.GptShape.from_hf_config(transformers.GPT2Config())
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        mc.GptShape.from_hf_config(hf_config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="attention_bias"):
        mc.GptShape.from_hf_config(hf_config("llama", attention_bias=True))
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide this model's num_key_value_heads=2"):
        mc.GptShape.from_hf_config(hf_config("qwen2")).check_tp(4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_optimizer_state_maps_through_hf_names_to_the_torch_backends_format(tmp_path, dtype):
    """A torch backend's optimizer.pt read into per-HF-name state and written back loads
    into a fresh torch backend, which then takes the same next step."""
    path = save_model("qwen2", tmp_path / "m")
    backend = TorchBackend(str(path), loss=PPO, lr=1e-3, dtype=dtype)
    backend.setup()
    batch = samples_for(37)
    for s, lps in zip(batch, backend.compute_logprobs(batch)):
        s.rollout_logprobs = lps
    adv = [1.0, -1.0] * 3
    backend.train_step(batch, adv)
    backend.save(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "optimizer.pt", weights_only=True)
    shape = mc.GptShape.from_hf_config(transformers.AutoConfig.from_pretrained(path))
    names = [n for n, _ in backend.model.named_parameters()]
    mixed = dtype == "bfloat16"
    states = mc.optimizer_state_from_torch(saved, names, mixed=mixed)
    assert set(states) == set(names) and {"exp_avg", "exp_avg_sq", "step"} <= set(states[names[0]])
    meg = {k: mc.hf_to_megatron({n: states[n][k] for n in names}, shape) for k in ("exp_avg", "exp_avg_sq")}
    back = {k: mc.megatron_to_hf(v, shape, include_tied=False) for k, v in meg.items()}
    rebuilt = {n: {**states[n], "exp_avg": back["exp_avg"][n], "exp_avg_sq": back["exp_avg_sq"][n]} for n in names}
    groups = (saved["optimizer"] if mixed else saved)["param_groups"]
    torch.save(mc.optimizer_state_to_torch(rebuilt, names, groups, mixed=mixed), tmp_path / "ckpt" / "optimizer.pt")
    expected = backend.train_step(batch, adv)
    fresh = TorchBackend(str(path), loss=PPO, lr=1e-3, dtype=dtype)
    fresh.setup()
    fresh.load(tmp_path / "ckpt")
    assert fresh.train_step(batch, adv)["loss"] == pytest.approx(expected["loss"], abs=1e-7)
    for name, t in fresh.named_weights().items():
        assert torch.equal(t, backend.named_weights()[name]), name
    with pytest.raises(ValueError, match="mixed-precision"):
        mc.optimizer_state_from_torch(saved, names, mixed=not mixed)


# -- config and factory ------------------------------------------------------------------


def test_megatron_is_refused_on_a_cpu_device_naming_the_key():
    cfg = TrainerConfig(backend="megatron")
    with pytest.raises(ValueError, match=r"^trainer\.backend: 'megatron' is not available: .*"
                                         r"(megatron\.core, which is not installed|trainer\.device='cpu')"):
        make_backend(cfg, "unused", seed=0, loss=PPO)


def test_a_missing_megatron_core_is_named_with_the_extra(monkeypatch):
    from actors.backends import config

    monkeypatch.setitem(config._PACKAGES, "megatron", "megatron_core_absent_here.core")
    reason = config.backend_unavailable("megatron", "cuda")
    assert reason.startswith("'megatron' is not available: this build has no megatron backend without "
                             "megatron_core_absent_here.core, which is not installed")
    assert 'pip install -e ".[megatron]"' in reason


def test_tensor_parallel_needs_the_megatron_backend():
    from actors.models import BUILTIN_MODEL_DIR

    with pytest.raises(ValueError, match=r"^trainer\.tensor_parallel_size: 2 needs backend: megatron"):
        make_backend(TrainerConfig(tensor_parallel_size=2), str(BUILTIN_MODEL_DIR), seed=0, loss=PPO)


@needs_megatron
def test_megatron_backend_is_built_for_cuda_with_its_config_section():
    from actors.backends.megatron_backend import MegatronBackend

    cfg = TrainerConfig(backend="megatron", device="cuda", dtype="bfloat16", lr=3e-6, tensor_parallel_size=2)
    backend = make_backend(cfg, "unused", seed=5, loss=PPO)
    assert isinstance(backend, MegatronBackend)
    assert (backend.lr, backend.seed, backend.tp_size, backend.dtype, backend.version) == (3e-6, 5, 2, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="master_dtype"):
        MegatronBackend("unused", loss=PPO, dtype="bfloat16", master_dtype=None)


# -- megatron-core's real modules on CPU --------------------------------------------------
#
# Megatron-core's GPT runs on CUDA; three spots stand in the way on a CPU, patched here
# only: the rotary embedding moves its frequencies to torch.cuda.current_device(), the
# attention forks the CUDA RNG tracker, and the backend's setup checks for CUDA and seeds
# that tracker. The plain-Adam path (distributed_optimizer=False) runs; Megatron's
# distributed optimizer allocates on CUDA and is left to the GPU tests.


@contextlib.contextmanager
def megatron_on_cpu():
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import random as mrandom

    from actors.backends.megatron_backend import MegatronBackend

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        mp.setattr(mrandom.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
        mp.setattr(MegatronBackend, "_init_device", lambda self: None)
        mp.setattr(MegatronBackend, "_seed_model_parallel_rng", lambda self: torch.manual_seed(self.seed))
        try:
            yield
        finally:
            mpu.destroy_model_parallel()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def _cpu_backends(path, dtype="float32", loss=PPO, **kw):
    from actors.backends.megatron_backend import MegatronBackend

    meg = MegatronBackend(str(path), loss=loss, device="cpu", dtype=dtype, lr=1e-3, distributed_optimizer=False, **kw)
    meg.setup()
    ref = TorchBackend(str(path), loss=loss, device="cpu", dtype=dtype, lr=1e-3, **kw)
    ref.setup()
    return meg, ref


@needs_megatron
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_megatron_gpt_on_cpu_computes_the_hf_models_logprobs_and_step(kind, tmp_path):
    """The map is right inside megatron-core's own modules: same log-probs as the torch
    backend (fp32, atol 2e-5), the same metrics and weights after one PPO step (plain Adam,
    lr 1e-3, every weight within 2e-5 but k_proj.bias: see _compare_weights), and each
    backend loads the other's checkpoint with equal weights and takes the same next step."""
    path = save_model(kind, tmp_path / "m")
    with megatron_on_cpu():
        meg, ref = _cpu_backends(path, micro_batch_tokens=40)  # several micro-batches
        batch = samples_for(37)
        lp_meg, lp_ref = meg.compute_logprobs(batch), ref.compute_logprobs(batch)
        for s, a, b in zip(batch, lp_meg, lp_ref):
            assert a == pytest.approx(b, abs=2e-5), s.uid
            s.rollout_logprobs = [x + 0.05 for x in b]  # a little off-policy: the ratio is not 1
        assert set(meg.named_weights()) == set(ref.named_weights())
        before = {k: v.clone() for k, v in ref.named_weights().items()}
        adv = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]
        m_meg, m_ref = meg.train_step(batch, adv), ref.train_step(batch, adv)
        for key in ("loss", "grad_norm", "tokens", "entropy", "clip_frac"):
            assert m_meg[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
        w_meg, w_ref = meg.named_weights(), {k: v.clone() for k, v in ref.named_weights().items()}
        _compare_weights(w_meg, w_ref, before, atol=2e-5, max_frac=0.0, what=f"{kind} fp32 step on CPU")
        meg.save(tmp_path / "from_megatron")
        ref.save(tmp_path / "from_torch")
        expected = ref.train_step(batch, adv)  # the step both resumed backends must repeat

        back_in_torch = TorchBackend(str(path), loss=PPO, device="cpu", lr=1e-3)
        back_in_torch.setup()
        back_in_torch.load(tmp_path / "from_megatron")
        for name, t in meg.named_weights().items():
            assert torch.equal(back_in_torch.named_weights()[name], t), name
        meg.load(tmp_path / "from_torch")
        assert meg.version == 1
        for name, t in w_ref.items():
            assert torch.equal(meg.named_weights()[name], t), name
        got = meg.train_step(batch, adv)
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        _compare_weights(meg.named_weights(), ref.named_weights(), w_ref, atol=4e-5, max_frac=0.0,
                         what="the step after megatron resumed the torch checkpoint")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "from_megatron", local_files_only=True)
    assert hf.config.model_type == kind
    for name, t in hf.state_dict().items():
        assert torch.equal(t, back_in_torch.model.state_dict()[name]), name


@needs_megatron
@pytest.mark.timeout(120)
def test_megatron_bf16_checkpoints_on_cpu_carry_fp32_main_params_and_moments_to_the_torch_backend(tmp_path):
    """Mixed precision: the checkpoint's optimizer.pt holds the fp32 main params (not only the
    bf16 weights) and Adam's moments under HF order, before any step and after one; the
    torch backend resumes it exactly (its next step equals megatron's own next step's loss)."""
    path = save_model("qwen2", tmp_path / "m")
    with megatron_on_cpu():
        meg, _ = _cpu_backends(path, dtype="bfloat16")
        meg.save(tmp_path / "v0")  # no moments yet
        batch = samples_for(37)
        for s_, lps in zip(batch, meg.compute_logprobs(batch)):
            s_.rollout_logprobs = [x + 0.05 for x in lps]
        adv = [1.0, -1.0] * 3
        meg.train_step(batch, adv)
        meg.save(tmp_path / "v1")
        expected = meg.train_step(batch, adv)
        weights_after = {k: v.clone() for k, v in meg.named_weights().items()}
        meg.load(tmp_path / "v0")  # resets the moments, back to version 0
        assert meg.version == 0 and not any(meg.optimizer.optimizer.state.values())
    torch_v0 = TorchBackend(str(path), loss=PPO, dtype="bfloat16", lr=1e-3)
    torch_v0.setup()
    torch_v0.load(tmp_path / "v0")
    resumed = TorchBackend(str(path), loss=PPO, dtype="bfloat16", lr=1e-3)
    resumed.setup()
    resumed.load(tmp_path / "v1")
    saved = torch.load(tmp_path / "v1" / "optimizer.pt", weights_only=True)
    assert set(saved) == {"optimizer", "main_params"} and saved["main_params"][0].dtype == torch.float32
    got = resumed.train_step(batch, adv)
    assert got["loss"] == pytest.approx(expected["loss"], abs=2e-3)
    before = {k: v.clone() for k, v in weights_after.items()}
    _compare_weights(weights_after, resumed.named_weights(), before, atol=1e-2, max_frac=2e-2,
                     what="bf16: megatron's second step vs the torch backend resumed from megatron's checkpoint")


def _max_diff(a: list[list[float]], b: list[list[float]]) -> tuple[float, float, str]:
    worst, total, count, where = 0.0, 0.0, 0, ""
    for i, (x, y) in enumerate(zip(a, b)):
        assert len(x) == len(y), f"sample {i}: {len(x)} log-probs vs {len(y)}"
        for j, (u, v) in enumerate(zip(x, y)):
            d = abs(u - v)
            total, count = total + d, count + 1
            if d > worst:
                worst, where = d, f"sample {i} token {j}: megatron {u:.6f} torch {v:.6f}"
    return worst, total / max(count, 1), where


def assert_bf16_as_close_as_torch(meg16: list, ref16: list, ref32: list, what: str) -> None:
    """bf16 log-probs carry bf16's rounding (the logits alone, |logit| ~ 5-10 here, round by
    0.02-0.04): Megatron's bf16 must be as close to the fp32 log-probs as the torch backend's
    bf16 is (mean within 1.25x + 0.005, max within 1.5x + 0.02)."""
    worst_m, mean_m, where = _max_diff(meg16, ref32)
    worst_t, mean_t, _ = _max_diff(ref16, ref32)
    assert mean_m <= 1.25 * mean_t + 0.005 and worst_m <= 1.5 * worst_t + 0.02, (
        f"{what}: |megatron bf16 - fp32| max {worst_m:.4f} mean {mean_m:.4f} (worst at {where}); "
        f"|torch bf16 - fp32| max {worst_t:.4f} mean {mean_t:.4f}")


@needs_megatron
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_megatron_gpt_on_cpu_in_bfloat16_is_as_close_to_fp32_as_the_torch_backend(kind, tmp_path):
    path = save_model(kind, tmp_path / "m")
    with megatron_on_cpu():
        meg, ref = _cpu_backends(path, dtype="bfloat16")
        ref32 = TorchBackend(str(path), loss=PPO, device="cpu", dtype="float32")
        ref32.setup()
        batch = samples_for(37, num=12)
        assert_bf16_as_close_as_torch(meg.compute_logprobs(batch), ref.compute_logprobs(batch),
                                      ref32.compute_logprobs(batch), f"{kind} on CPU")


# -- on a GPU: the backend against the torch backend ------------------------------------------
#
# Tolerances (stated per test): fp32 log-probs agree to 1e-4 (two implementations of the
# same math: SDPA vs Megatron's baddbmm + softmax); bf16 log-probs are as close to fp32 as
# the torch backend's bf16 ones (bf16 rounds in different places: RMSNorm, rotary, logits).
# One PPO step at lr 1e-3: fp32 weights agree to 5e-5 (Adam's first step is lr * sign(grad):
# an element whose grad is within fp32 noise of 0 may step differently; at most 0.1 % may).


def _gpu_backends(path, dtype, *, distributed_optimizer=True, lr=1e-3):
    from actors.backends.megatron_backend import MegatronBackend

    meg = MegatronBackend(str(path), loss=PPO, device="cuda", dtype=dtype, lr=lr,
                          distributed_optimizer=distributed_optimizer)
    meg.setup()
    ref = TorchBackend(str(path), loss=PPO, device="cuda", dtype=dtype, lr=lr)
    ref.setup()
    return meg, ref


@pytest.mark.gpu
@needs_megatron
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_logprobs_match_the_torch_backend(kind, dtype, tmp_path):
    """fp32: |megatron - torch| <= 1e-4 per token (max), 1e-5 mean. bf16: as close to the
    fp32 log-probs as the torch backend's bf16 (assert_bf16_as_close_as_torch)."""
    path = save_model(kind, tmp_path / "m", dtype=torch.float32)
    meg, ref = _gpu_backends(path, dtype)
    batch = samples_for(37, num=8)
    got, expected = meg.compute_logprobs(batch), ref.compute_logprobs(batch)
    if dtype == "bfloat16":
        ref32 = TorchBackend(str(path), loss=PPO, device="cuda", dtype="float32")
        ref32.setup()
        assert_bf16_as_close_as_torch(got, expected, ref32.compute_logprobs(batch), f"{kind} on the GPU")
        return
    worst, mean, where = _max_diff(got, expected)
    assert worst <= 1e-4 and mean <= 1e-5, (
        f"{kind} fp32: log-prob |megatron - torch| max {worst:.3g} (tol 1e-4) at {where}, mean {mean:.3g} (tol 1e-5)")


def _compare_weights(meg: dict, ref: dict, before: dict, *, atol: float, max_frac: float, what: str,
                     lr: float = 1e-3) -> None:
    """Weights after a step: at most ``max_frac`` of the elements off by more than ``atol``.
    k_proj.bias is held to one Adam step (2 lr) instead: its gradient is zero in exact
    arithmetic (a key bias adds the same q.b to every score of a query, which softmax
    ignores), so each backend's first Adam step on it is lr * sign(rounding noise)."""
    assert set(meg) == set(ref), f"{what}: names differ: {sorted(set(meg) ^ set(ref))}"
    bad_total = numel = 0
    report = []
    for name, t in ref.items():
        a, b = meg[name].float().cpu(), t.float().cpu()
        assert a.shape == b.shape, f"{what}: {name} shape {tuple(a.shape)} vs {tuple(b.shape)}"
        bad = (a - b).abs() > (atol + 2 * lr if name.endswith("k_proj.bias") else atol)
        bad_total, numel = bad_total + int(bad.sum()), numel + b.numel()
        if bad.any():
            d = (a - b).abs()
            moved = (b - before[name].float().cpu()).abs().max()
            report.append(f"{name}: {int(bad.sum())}/{b.numel()} elements off by > {atol} (max {d.max():.3g}; "
                          f"the torch step moved it by up to {moved:.3g})")
    assert bad_total <= max_frac * numel, (f"{what}: {bad_total} of {numel} weights differ by more than {atol} "
                                           f"(allowed {max_frac:.2%}):\n" + "\n".join(report[:20]))


@pytest.mark.gpu
@needs_megatron
@pytest.mark.parametrize("distributed_optimizer", [True, False])
@pytest.mark.parametrize(("dtype", "atol", "max_frac"), [("float32", 5e-5, 1e-3), ("bfloat16", 1e-2, 1e-2)])
def test_gpu_one_grpo_step_changes_the_weights_as_the_torch_backend(dtype, atol, max_frac, distributed_optimizer,
                                                                      tmp_path):
    """fp32: weights within 5e-5 (at most 0.1 % of them further), loss within 1e-5, grad norm
    within 0.1 %. bf16: the weights are bf16 (an ulp is 2^-8 of the value, ~4e-3 near 1) and
    Adam's first step is +-lr = 1e-3, so an element whose bf16 grad has the other sign is off
    by 2e-3 and a rounding boundary by an ulp: within 1e-2 (at most 1 % further); loss within
    0.03, grad norm within 10 %. (On CPU, megatron-core's modules in bf16 against the torch
    backend: max weight difference 3.9e-3, loss 0.005, grad norm 3 %.)"""
    path = save_model("qwen2", tmp_path / "m")
    meg, ref = _gpu_backends(path, dtype, distributed_optimizer=distributed_optimizer)
    batch = samples_for(37, num=8)
    for s, lps in zip(batch, ref.compute_logprobs(batch)):
        s.rollout_logprobs = [x + 0.05 for x in lps]
    before = {k: v.clone() for k, v in ref.named_weights().items()}
    adv = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25]
    m_meg, m_ref = meg.train_step(batch, adv), ref.train_step(batch, adv)
    tols = {"loss": dict(abs=1e-5), "grad_norm": dict(rel=1e-3), "tokens": dict(abs=0)}
    if dtype == "bfloat16":
        tols = {"loss": dict(abs=0.03), "grad_norm": dict(rel=0.1), "tokens": dict(abs=0)}
    for key, tol in tols.items():
        assert m_meg[key] == pytest.approx(m_ref[key], **tol), f"{dtype} metric {key}: megatron {m_meg[key]} torch {m_ref[key]} ({tol})"
    assert meg.version == ref.version == 1
    _compare_weights(meg.named_weights(), ref.named_weights(), before, atol=atol, max_frac=max_frac,
                     what=f"{dtype} step, distributed_optimizer={distributed_optimizer}")


@pytest.mark.gpu
@needs_megatron
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_checkpoints_load_in_transformers_and_in_either_backend(dtype, tmp_path):
    path = save_model("qwen2", tmp_path / "m")
    meg, ref = _gpu_backends(path, dtype)
    batch = samples_for(37)
    for s, lps in zip(batch, ref.compute_logprobs(batch)):
        s.rollout_logprobs = lps
    adv = [1.0, -1.0] * 3
    meg.train_step(batch, adv)
    meg.save(tmp_path / "meg")
    files = sorted(p.name for p in (tmp_path / "meg").iterdir())
    assert {"config.json", "model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(files), files
    weights = {k: v.detach().cpu() for k, v in meg.named_weights().items()}

    config = json.loads((tmp_path / "meg" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == dtype, config
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "meg", local_files_only=True)
    for name, t in hf.state_dict().items():  # whatever dtype transformers loads it in: bf16 -> fp32 is exact
        assert torch.equal(t.to(weights[name].dtype), weights[name]), f"transformers' {name} differs from megatron's"

    resumed_torch = TorchBackend(str(path), loss=PPO, device="cuda", dtype=dtype, lr=1e-3)
    resumed_torch.setup()
    resumed_torch.load(tmp_path / "meg")
    assert resumed_torch.version == 1
    for name, t in resumed_torch.named_weights().items():
        assert torch.equal(t.cpu(), weights[name]), f"the torch backend's {name} after loading differs"
    # the next step from the same weights and optimizer state agrees as one step does
    before = {k: v.clone() for k, v in weights.items()}
    meg.train_step(batch, adv)
    resumed_torch.train_step(batch, adv)
    atol, frac = (5e-5, 1e-3) if dtype == "float32" else (1e-2, 1e-2)
    _compare_weights(meg.named_weights(), resumed_torch.named_weights(), before, atol=atol, max_frac=frac,
                     what=f"{dtype}: the step after the torch backend resumed megatron's checkpoint")

    ref.train_step(batch, adv)
    ref.save(tmp_path / "torch")
    meg.load(tmp_path / "torch")
    assert meg.version == 1
    for name, t in ref.named_weights().items():
        assert torch.equal(meg.named_weights()[name].cpu(), t.cpu()), f"megatron's {name} after loading the torch checkpoint"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp2_worker(rank: int, port: int, path: str, out: str) -> None:
    """One of two ranks of a TP 2 Megatron backend: log-probs, one step, its HF slices."""
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from actors.backends.megatron_backend import MegatronBackend

    meg = MegatronBackend(path, loss=PPO, device=f"cuda:{rank}", dtype="float32", lr=1e-3, tensor_parallel_size=2)
    meg.setup()
    batch = samples_for(37, num=8)
    mine = batch[rank::2]  # each rank its own samples: the TP group trains on their union
    logprobs = meg.compute_logprobs(mine)
    for s, lps in zip(mine, logprobs):
        s.rollout_logprobs = [x + 0.05 for x in lps]
    adv = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25][rank::2]
    metrics = meg.train_step(mine, adv)
    weights = {k: v.cpu() for k, v in meg.named_weights().items()}
    specs = {k: (v.full_shape, v.dim, v.offset, v.length) for k, v in meg.shard_specs().items()}
    torch.save({"logprobs": logprobs, "metrics": metrics, "weights": weights, "specs": specs}, f"{out}/rank{rank}.pt")
    meg.save(f"{out}/ckpt")
    torch.distributed.destroy_process_group()


@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel 2 needs two GPUs")
@pytest.mark.timeout(300)
def test_gpu_tensor_parallel_2_matches_the_torch_backend(tmp_path):
    import torch.multiprocessing as tmp

    path = save_model("qwen2", tmp_path / "m")
    tmp.spawn(_tp2_worker, args=(_free_port(), str(path), str(tmp_path)), nprocs=2, join=True)
    ref = TorchBackend(str(path), loss=PPO, device="cuda", dtype="float32", lr=1e-3)
    ref.setup()
    batch = samples_for(37, num=8)
    expected = ref.compute_logprobs(batch)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    got = [None] * len(batch)
    got[0::2], got[1::2] = ranks[0]["logprobs"], ranks[1]["logprobs"]
    worst, _, where = _max_diff(got, expected)
    assert worst <= 1e-4, f"TP 2 log-probs differ from the torch backend's by {worst:.3g} at {where}"
    for s, lps in zip(batch, expected):
        s.rollout_logprobs = [x + 0.05 for x in lps]
    before = {k: v.clone() for k, v in ref.named_weights().items()}
    ref.train_step(batch, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25])
    assembled = {}
    for r in ranks:
        for name, t in r["weights"].items():
            full_shape, dim, offset, length = r["specs"][name]
            full = assembled.setdefault(name, torch.zeros(full_shape))
            full.narrow(dim, offset, length).copy_(t)
    _compare_weights(assembled, ref.named_weights(), before, atol=5e-5, max_frac=1e-3, what="TP 2 shards, assembled")
    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state["version"] == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    for name, t in hf.state_dict().items():
        torch.testing.assert_close(t, assembled[name], atol=0, rtol=0, msg=lambda m, n=name: f"TP 2 checkpoint {n}: {m}")
