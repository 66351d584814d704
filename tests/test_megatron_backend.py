"""The Megatron-core backend: the real megatron-core modules run on CPU with the
HF <-> Megatron maps (where megatron-core is installed), and the backend on a GPU
against the torch backend (``gpu`` marker). The maps alone, on CPU in pure torch,
are in tests/test_megatron_convert.py.

GPU tests (TP 1; TP 2 only with two GPUs) are self-contained: each builds a
small Qwen2 / Llama checkpoint of its own with transformers, and they run in one
process (torch.distributed and Megatron's parallel state are initialised once,
world size 1, by the first backend's setup).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import transformers

from actors.backends import TrainerConfig, make_backend
from actors.backends.torch_backend import TorchBackend
from policies.losses import make_loss
from tests.extras import needs_mark
from tests.helpers import free_port, samples_for, save_model

PPO = make_loss("ppo_clip")
needs_megatron = needs_mark("megatron.core", "megatron")


# -- config and factory ------------------------------------------------------------------


def test_megatron_is_refused_on_a_cpu_device_naming_the_key():
    cfg = TrainerConfig(backend="megatron")
    with pytest.raises(ValueError, match=r"^trainer\.backend: 'megatron' is not available: .*"
                                         r"(megatron\.core, which is not installed|trainer\.device='cpu')"):
        make_backend(cfg, "unused", seed=0, loss=PPO)


def test_a_missing_megatron_core_is_named_with_the_extra(monkeypatch):
    from actors.backends import registry

    monkeypatch.setattr(registry, "MEGATRON_PACKAGE", "megatron_core_absent_here.core")
    reason = registry.backend_unavailable(TrainerConfig(backend="megatron", device="cuda"))
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
    tmp.spawn(_tp2_worker, args=(free_port(), str(path), str(tmp_path)), nprocs=2, join=True)
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
