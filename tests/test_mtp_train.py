"""Multi-token prediction in the torch trainer backend (``model.mtp_layers``; docs/mtp.md):
the modules start as the spec says or as the checkpoint has them, the auxiliary loss trains
them, and every weight path (push, checkpoint, resume, FSDP2) carries them. The tiny Qwen2,
fp32, on CPU."""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest
import torch
import torch.multiprocessing as mp

from actors.backends import TrainerConfig, make_backend
from actors.backends.mtp import mtp_logits, mtp_positions
from actors.backends.mtp_weights import mtp_module_count
from actors.backends.torch_backend import TorchBackend
from actors.models import BUILTIN_MODEL_DIR
from contracts.sample import Sample
from policies.losses import make_loss
from tests.helpers import free_port, samples_for

pytestmark = pytest.mark.timeout(180)

PPO = make_loss("ppo_clip")
H, L = 128, 2  # the tiny model's hidden size and decoder layers
LAYER = ["self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
         "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
         "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]


def _samples(num: int = 6) -> list[Sample]:
    out = samples_for(21, num=num)
    for s in out:
        s.rollout_logprobs = [-1.0] * len(s.response_ids)
    return out


def _backend(model_path=BUILTIN_MODEL_DIR, mtp_layers: int = 2, **kw) -> TorchBackend:
    kw = {"lr": 1e-3, "mtp_loss_weight": 1.0, **kw}
    b = TorchBackend(str(model_path), loss=PPO, mtp_layers=mtp_layers, **kw)
    b.setup()
    return b


def _mtp(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in backend.named_weights().items() if k.startswith("mtp.")}


def test_named_weights_carry_the_spec_names_and_shapes():
    w = _backend().named_weights()
    expected = {}
    for k in range(2):
        p = f"mtp.{k}."
        expected.update({p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
                         p + "norm.weight": (H,)})
        expected.update({p + "layer." + n: tuple(w[f"model.layers.0.{n}"].shape) for n in LAYER})
    assert {k: tuple(v.shape) for k, v in w.items() if k.startswith("mtp.")} == expected


def test_modules_start_from_the_last_decoder_layer_when_the_checkpoint_has_none():
    w = _backend().named_weights()
    for k in range(2):
        p = f"mtp.{k}."
        for n in LAYER:
            assert torch.equal(w[p + "layer." + n], w[f"model.layers.{L - 1}.{n}"]), n
        assert torch.equal(w[p + "enorm.weight"], torch.ones(H)) and torch.equal(w[p + "hnorm.weight"], torch.ones(H))
        assert torch.equal(w[p + "norm.weight"], w["model.norm.weight"])
        assert torch.equal(w[p + "eh_proj.weight"], torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1))
        assert w[p + "norm.weight"].data_ptr() != w["model.norm.weight"].data_ptr()  # a copy, trained apart


def test_mtp_layers_zero_leaves_the_params_and_the_model_as_they_were():
    plain = TorchBackend(str(BUILTIN_MODEL_DIR), loss=PPO)
    plain.setup()
    names = [n for n, _ in plain.model.named_parameters()]
    assert not any(n.startswith("mtp") for n in plain.named_weights())
    assert not hasattr(plain.model, "mtp") and plain._mtp is None
    assert not plain.model.lm_head._forward_pre_hooks and not plain.model.model.embed_tokens._forward_hooks
    with_mtp = _backend(mtp_layers=1)
    assert [n for n, _ in with_mtp.model.named_parameters() if not n.startswith("mtp.")] == names


def test_the_aux_loss_raises_next_next_token_accuracy_on_a_fixed_batch():
    """Advantages 0: only the MTP loss has a gradient. Over 30 steps on one batch module 0
    learns to predict t[i+2] there (it memorises), and module 1 t[i+3]."""
    b = _backend(lr=3e-3)
    samples = _samples()
    metrics = [b.train_step(samples, [0.0] * len(samples)) for _ in range(30)]
    first, last = metrics[0], metrics[-1]
    for k in range(2):
        assert last[f"mtp/acc_{k}"] >= first[f"mtp/acc_{k}"] + 0.4, (first, last)
        assert last[f"mtp/loss_{k}"] < 0.5 * first[f"mtp/loss_{k}"], (first, last)
    assert first["loss"] == 0.0


def test_packed_padded_and_checkpointed_batches_give_the_same_aux_loss_and_step():
    """The MTP layers attend within each packed sequence as over a padded row, and
    activation checkpointing (which recomputes the copied layer too) changes nothing."""
    samples = _samples()
    runs = {}
    for name, kw in {"packed": {}, "padded": {"packed": False}, "checkpointed": {"activation_checkpointing": True}}.items():
        b = _backend(**kw)
        assert b.packed == (name != "padded")
        runs[name] = ([b.train_step(samples, [0.5, -0.5] * 3) for _ in range(2)], _mtp(b))
    for other in ("padded", "checkpointed"):
        for got, want in zip(runs[other][0], runs["packed"][0]):
            for key in ("mtp/loss_0", "mtp/loss_1", "mtp/acc_0", "mtp/acc_1", "loss"):
                assert got[key] == pytest.approx(want[key], abs=1e-5), (other, key)
        for name, t in runs[other][1].items():  # Adam's step turns 1e-9 grads' fp32 noise into ~1e-5 (lr 1e-3)
            torch.testing.assert_close(t, runs["packed"][1][name], atol=1e-4, rtol=1e-4)


def test_scored_positions_are_the_response_targets_two_and_three_ahead_within_each_sequence():
    s = [Sample(uid="a", group_id="g", prompt_ids=[1, 2, 3], response_ids=[4, 5, 6]),
         Sample(uid="b", group_id="g", prompt_ids=[7], response_ids=[8, 9])]
    pos, tgt = mtp_positions(s, [0, 6], 0)  # module 0 at i predicts t[i+2]
    assert pos.tolist() == [1, 2, 3, 6] and tgt.tolist() == [4, 5, 6, 9]
    pos, tgt = mtp_positions(s, [0, 6], 1)  # module 1: t[i+3]; "b" has no such target
    assert pos.tolist() == [0, 1, 2] and tgt.tolist() == [4, 5, 6]


def test_mtp_logits_give_the_loss_the_training_step_reports():
    b = _backend()
    sample = _samples(1)[0]
    ids = sample.prompt_ids + sample.response_ids
    logits = mtp_logits(b, ids)
    assert [tuple(x.shape) for x in logits] == [(len(ids), 21)] * 2
    metrics = b.train_step([sample], [0.0])  # metrics of the weights before the step
    for k in range(2):
        pos, tgt = mtp_positions([sample], [0], k)
        ce = torch.nn.functional.cross_entropy(logits[k][torch.as_tensor(pos)], torch.as_tensor(tgt))
        assert metrics[f"mtp/loss_{k}"] == pytest.approx(float(ce), abs=1e-5)


def test_a_saved_checkpoint_gives_its_modules_to_a_fresh_backend(tmp_path):
    b = _backend()
    b.train_step(_samples(), [0.0] * 6)
    trained = _mtp(b)
    b.save(tmp_path / "ckpt")
    fresh = _backend(tmp_path / "ckpt")
    assert all(torch.equal(fresh.named_weights()[n], t) for n, t in trained.items())
    more = _backend(tmp_path / "ckpt", mtp_layers=3)  # modules 0 and 1 loaded, 2 started per the spec
    w = more.named_weights()
    assert torch.equal(w["mtp.1.eh_proj.weight"], trained["mtp.1.eh_proj.weight"])
    assert torch.equal(w["mtp.2.layer.mlp.up_proj.weight"], w[f"model.layers.{L - 1}.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=r"has 2 MTP modules \(mtp\.0\.\.mtp\.1\) and model\.mtp_layers is 1"):
        _backend(tmp_path / "ckpt", mtp_layers=1)


def test_resume_keeps_mtp_weights_and_their_optimizer_state(tmp_path):
    samples, adv = _samples(), [0.5, -0.5] * 3
    a = _backend()
    for _ in range(2):
        a.train_step(samples, adv)
    a.save(tmp_path / "ckpt")
    b = _backend()
    b.load(tmp_path / "ckpt")
    assert b.version == 2
    params = dict(a.model.named_parameters())
    state_a, state_b = a.optimizer.state, b.optimizer.state
    for name, p in b.model.named_parameters():
        if name.startswith("mtp."):
            assert torch.equal(p, params[name])
            assert torch.equal(state_b[p]["exp_avg_sq"], state_a[params[name]]["exp_avg_sq"]), name
    a.train_step(samples, adv)
    b.train_step(samples, adv)
    for name, t in _mtp(a).items():
        assert torch.equal(t, b.named_weights()[name]), name
    plain = TorchBackend(str(BUILTIN_MODEL_DIR), loss=PPO)
    plain.setup()
    with pytest.raises(ValueError, match=r"does not match the model: .*unexpected \['mtp\.0\.eh_proj\.weight'"):
        plain.load(tmp_path / "ckpt")


def test_an_export_carries_the_modules_and_starts_a_backend_with_them(tmp_path):
    import safetensors.torch
    import transformers

    from actors.config import Config, ModelConfig
    from actors.export import write_hf_dir

    b = _backend()
    b.train_step(_samples(), [0.0] * 6)
    b.save(tmp_path / "trainer")
    cfg = Config(model=ModelConfig(path=str(BUILTIN_MODEL_DIR), mtp_layers=2))
    out = write_hf_dir(tmp_path / "trainer", cfg, tmp_path / "export", dtype="bfloat16")
    saved = safetensors.torch.load_file(str(out / "model.safetensors"))
    for name, t in _mtp(b).items():
        assert torch.equal(saved[name], t.to(torch.bfloat16)), name
    transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)  # HF skips mtp.*
    again = _backend(out)
    assert torch.equal(again.named_weights()["mtp.1.norm.weight"], saved["mtp.1.norm.weight"].float())


def test_muon_steps_the_mtp_matrices():
    from actors.backends.config import MuonConfig

    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is not in this torch")
    b = _backend(muon=MuonConfig())
    muon_params = {id(p) for g in b.optimizer.muon.param_groups for p in g["params"]}
    names = {n for n, p in b.model.named_parameters() if id(p) in muon_params}
    assert {"mtp.0.eh_proj.weight", "mtp.1.layer.mlp.down_proj.weight"} <= names
    assert "mtp.0.norm.weight" not in names


def _largest_step(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], mtp: bool) -> float:
    return max(float((after[n] - t).abs().max()) for n, t in before.items() if n.startswith("mtp.") == mtp)


def test_mtp_lr_steps_the_modules_at_their_own_rate_and_resume_keeps_it(tmp_path):
    """Adam's first step moves each element by about its lr: 1e-2 for the modules, 1e-4 for the policy."""
    samples, adv = _samples(), [0.5, -0.5] * 3
    b = _backend(lr=1e-4, mtp_lr=1e-2, grad_clip=1e9)
    assert [g["lr"] for g in b.optimizer.param_groups] == [1e-4, 1e-2]
    before = {n: t.clone() for n, t in b.named_weights().items()}
    b.train_step(samples, adv)
    after = b.named_weights()
    assert 0.9e-2 < _largest_step(before, after, mtp=True) <= 1.001e-2
    assert 0 < _largest_step(before, after, mtp=False) <= 1.001e-4
    saved = b.optimizer.state_dict()["state"]  # indexed in the model's param order, as FSDP2's re-shard reads it
    for i, p in enumerate(b.model.parameters()):
        assert torch.equal(saved[i]["exp_avg"], b.optimizer.state[p]["exp_avg"]), i
    b.save(tmp_path / "ckpt")
    again = _backend(lr=1e-4, mtp_lr=1e-2, grad_clip=1e9)
    again.load(tmp_path / "ckpt")
    b.train_step(samples, adv)
    again.train_step(samples, adv)
    for name, t in b.named_weights().items():
        assert torch.equal(t, again.named_weights()[name]), name


def test_mtp_lr_reaches_muons_matrices_and_the_main_params():
    from actors.backends.config import MuonConfig

    main = _backend(dtype="bfloat16", master_dtype="float32", lr=1e-4, mtp_lr=1e-2)
    groups = main.optimizer.optimizer.param_groups  # over the fp32 main params
    num_mtp = sum(n.startswith("mtp.") for n, _ in main.model.named_parameters())
    assert [g["lr"] for g in groups] == [1e-4, 1e-2] and len(groups[1]["params"]) == num_mtp
    assert all(p.dtype == torch.float32 for p in groups[1]["params"])
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is not in this torch")
    muon = _backend(muon=MuonConfig(), lr=1e-4, mtp_lr=1e-2).optimizer
    for opt in (muon.muon, muon.adamw):
        first, mtp = opt.param_groups
        assert mtp["lr"] == pytest.approx(100 * first["lr"]) and mtp["weight_decay"] == first["weight_decay"]


def test_mtp_lr_without_modules_or_off_the_torch_backend_is_refused():
    from actors.config import ConfigError, load_config

    with pytest.raises(ValueError, match="mtp_lr 0.001: > 0, only with mtp_layers > 0"):
        TorchBackend(str(BUILTIN_MODEL_DIR), loss=PPO, mtp_lr=1e-3)
    with pytest.raises(ConfigError, match="trainer.mtp_lr: .*set model.mtp_layers > 0"):
        load_config(None, ["trainer.mtp_lr=1e-3"])
    with pytest.raises(ValueError, match="mtp_lr must be null with backend 'megatron'"):
        TrainerConfig(backend="megatron", mtp_lr=1e-3)


def no_mtp_backend(cfg, model_path, *, seed, loss):
    """A third-party backend's factory that knows nothing of MTP."""
    raise AssertionError("never built: make_backend refuses it first")


def test_make_backend_passes_mtp_layers_and_refuses_a_factory_without_it():
    cfg = TrainerConfig()
    backend = make_backend(cfg, str(BUILTIN_MODEL_DIR), seed=0, loss=PPO, mtp_layers=2)
    assert backend.mtp_layers == 2 and backend.mtp_loss_weight == cfg.mtp_loss_weight == 0.1
    cfg = TrainerConfig(backend="tests.test_mtp_train:no_mtp_backend")
    with pytest.raises(ValueError, match=r"^trainer\.backend tests\.test_mtp_train:no_mtp_backend does not support "
                                         r"model\.mtp_layers$"):
        make_backend(cfg, "unused", seed=0, loss=PPO, mtp_layers=1)
    with pytest.raises(msgspec.ValidationError, match="mtp_loss_weight"):
        msgspec.convert({"mtp_loss_weight": -1.0}, TrainerConfig)
    with pytest.raises(ValueError, match=r"^trainer\.compile: not with model\.mtp_layers"):
        make_backend(TrainerConfig(compile=True), str(BUILTIN_MODEL_DIR), seed=0, loss=PPO, mtp_layers=1)


def test_module_count_reads_the_highest_index():
    assert mtp_module_count(["model.norm.weight", "mtp.0.norm.weight", "mtp.3.eh_proj.weight"]) == 4
    assert mtp_module_count(["model.norm.weight"]) == 0


# -- FSDP2: two ranks (gloo) against one worker -------------------------------------------


def _dp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        samples = _samples(8)
        # rank 1 takes one more pass than rank 0 (a weight-0 filler pass on rank 0 joins its collectives)
        mine = samples[:3] if rank == 0 else samples[3:]
        b = _backend(packed=False, micro_batch_tokens=40, mtp_lr=3e-3)  # the modules' group on the shards too
        metrics = [b.train_step(mine, [0.5, -0.5, 0.25, -0.25, 0.1][: len(mine)]) for _ in range(2)]
        specs = b.shard_specs()
        full = {k: v.full_tensor().clone() for k, v in b.model.state_dict().items() if k.startswith("mtp.")}
        b.save(os.path.join(out_dir, "ckpt"))
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump({"metrics": metrics, "full": full, "specs": {k: v for k, v in specs.items()
                                                                     if k.startswith("mtp.")}}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_fsdp2_ranks_train_and_shard_the_mtp_modules_as_one_worker(tmp_path):
    mp.spawn(_dp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    samples = _samples(8)
    adv = [0.5, -0.5, 0.25] + [0.5, -0.5, 0.25, -0.25, 0.1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _backend(packed=False, micro_batch_tokens=40, mtp_lr=3e-3)
        want = [single.train_step(samples, adv) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    for got, exp in zip(ranks[0]["metrics"], want):
        for key in ("mtp/loss_0", "mtp/acc_1", "loss"):
            assert got[key] == pytest.approx(exp[key], abs=1e-5), key
    spec = ranks[1]["specs"]["mtp.0.layer.mlp.up_proj.weight"]
    assert spec.full_shape == (384, H) and spec.length == 192 and spec.offset == 192
    for name, t in single.named_weights().items():
        if name.startswith("mtp."):
            torch.testing.assert_close(ranks[0]["full"][name], t, atol=1e-5, rtol=1e-4)
    fresh = _backend(tmp_path / "ckpt")  # the sharded checkpoint carries them
    for name, t in ranks[0]["full"].items():
        assert torch.equal(fresh.named_weights()[name], t), name


@pytest.mark.parametrize("detach", [True, False])
def test_a_detached_mtp_loss_leaves_the_policys_update_as_without_mtp(detach):
    """trainer.mtp_detach (the default): the modules learn, the policy's weights take the very step
    they take without MTP; a joint loss (false) moves them too. No clipping: the global norm
    would count the modules' gradients."""
    samples, adv = _samples(), [0.5, -0.5] * 3
    plain = _backend(mtp_layers=0, grad_clip=1e9)
    plain.train_step(samples, adv)
    mtp = _backend(mtp_detach=detach, grad_clip=1e9)
    before = _mtp(mtp)
    mtp.train_step(samples, adv)
    policy = {n: t for n, t in mtp.named_weights().items() if not n.startswith("mtp.")}
    same = all(torch.equal(policy[n], t) for n, t in plain.named_weights().items())
    assert same is detach
    assert any(not torch.equal(t, before[n]) for n, t in _mtp(mtp).items())  # the modules learn either way
