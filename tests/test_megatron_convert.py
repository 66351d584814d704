"""The Megatron-core backend's HF <-> Megatron weight maps (``actors/backends/megatron_convert.py``),
on CPU in pure torch (no megatron-core needed): the fused QKV and fc1 layouts, tensor-parallel
slices, parameter order, refused models, and the optimizer state through HF names. The
backend itself (megatron-core's modules on CPU, then on a GPU) is in tests/test_megatron_backend.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from actors.backends import megatron_convert as mc
from actors.backends.torch_backend import TorchBackend
from policies.losses import make_loss
from tests.helpers import hf_config, hf_model, samples_for, save_model

PPO = make_loss("ppo_clip")


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


def _with_mtp(model: transformers.PreTrainedModel, num_mtp: int, tmp_path) -> mc.GptShape:
    """``model`` with ``num_mtp`` MTP modules (``model.mtp``), their weights random so that a
    map that mixes two of them up shows; the shape with ``mtp_layers`` set."""
    from actors.backends.mtp import attach_mtp

    attach_mtp(model, num_mtp, tmp_path)  # a directory without weights: every module initialised
    with torch.no_grad():
        for p in model.mtp.parameters():
            p.copy_(torch.randn_like(p))
    return dataclasses.replace(mc.GptShape.from_hf_config(model.config), mtp_layers=num_mtp)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_mtp_modules_map_to_megatrons_names_and_back_exactly(kind, tmp_path):
    model = hf_model(kind)
    shape = _with_mtp(model, 2, tmp_path)
    hf = model.state_dict()
    meg = mc.hf_to_megatron(hf, shape)
    assert list(meg) == mc.megatron_names(shape)
    p = "mtp.layers.1."
    assert {p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight", p + "final_layernorm.weight",
            p + "transformer_layer.mlp.linear_fc1.weight"} <= set(meg)
    assert torch.equal(meg[p + "final_layernorm.weight"], hf["mtp.1.norm.weight"])
    assert torch.equal(meg[p + "transformer_layer.self_attention.linear_qkv.weight"],
                       mc.fuse_qkv(*(hf[f"mtp.1.layer.self_attn.{x}_proj.weight"] for x in "qkv"), 2))
    assert tuple(meg[p + "eh_proj.weight"].shape) == (64, 128)
    back = mc.megatron_to_hf(meg, shape)
    assert list(back) == list(hf)  # the torch backend's state_dict order, mtp.* last
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    names = [n for n in mc.hf_full_shapes(shape) if not (shape.tied and n == "lm_head.weight")]
    assert names == [n for n, _ in model.named_parameters()]  # the optimizer state's order
    assert {n: tuple(t.shape) for n, t in hf.items()} == {n: s for n, s in mc.hf_full_shapes(shape).items()
                                                         if n in hf}


@pytest.mark.parametrize("kind,num_mtp", [("qwen2", 0), ("llama", 0), ("qwen2", 1)])
def test_tensor_parallel_slices_of_two_ranks_assemble_every_hf_tensor(kind, num_mtp, tmp_path):
    """Each rank's local Megatron tensors give contiguous HF slices; together they tile each
    HF tensor exactly once (norms: whole on each rank); the padded vocabulary row is dropped.
    An MTP module's eh_proj is split by rows (column parallel), its layer as the others."""
    model = hf_model(kind)
    shape = _with_mtp(model, num_mtp, tmp_path) if num_mtp else mc.GptShape.from_hf_config(model.config)
    hf = model.state_dict()
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
