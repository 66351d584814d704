import pytest
import torch

from actors.backends.batching import micro_batches
from actors.backends import TrainerBackend, TrainerConfig, make_backend
from actors.backends import registry as backend_registry
from actors.backends.torch_backend import TorchBackend
from actors.models import BUILTIN_MODEL_DIR, load_causal_lm
from contracts.sample import Sample
from policies.losses import make_loss

PPO = make_loss("ppo_clip")


def _samples(backend: TorchBackend) -> list[Sample]:
    """Two responses to one reverse_digits prompt, with on-policy rollout log-probs."""
    prompt = [1, 15, 4, 5, 6, 13]  # <bos> R 1 2 3 :
    out = [
        Sample(uid="a", group_id="g", prompt_ids=prompt, response_ids=[6, 5, 4, 2]),  # "321<eos>"
        Sample(uid="b", group_id="g", prompt_ids=prompt, response_ids=[9, 2]),  # "6<eos>"
    ]
    for s, lps in zip(out, backend.compute_logprobs(out)):
        s.rollout_logprobs = lps
    return out


@pytest.fixture
def backend():
    b = TorchBackend(str(BUILTIN_MODEL_DIR), loss=PPO, lr=1e-3, seed=0)
    b.setup()
    return b


def test_logprobs_match_a_plain_forward_pass(backend):
    samples = _samples(backend)
    model = load_causal_lm(BUILTIN_MODEL_DIR)
    ids = torch.tensor([samples[1].prompt_ids + samples[1].response_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
    p = len(samples[1].prompt_ids)
    expected = [logp[p - 1 + j, t].item() for j, t in enumerate(samples[1].response_ids)]
    assert [len(s.rollout_logprobs) for s in samples] == [4, 2]
    assert samples[1].rollout_logprobs == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("loss", ["ppo_clip", "decoupled_ppo", "tis_token", "tis_seq"])
def test_one_step_with_positive_advantage_raises_that_responses_logprob(loss):
    backend = TorchBackend(str(BUILTIN_MODEL_DIR), lr=1e-3, loss=make_loss(loss))
    backend.setup()
    samples = _samples(backend)
    before = [sum(s.rollout_logprobs) for s in samples]
    metrics = backend.train_step(samples, [1.0, -1.0])
    after = [sum(lp) for lp in backend.compute_logprobs(samples)]
    assert after[0] > before[0] and after[1] < before[1]
    assert backend.version == 1
    assert metrics["tokens"] == 6.0 and metrics["grad_norm"] > 0
    assert {"loss", "grad_norm", "entropy", "tokens"} <= metrics.keys()


def test_named_weights_use_hf_names_including_the_tied_head(backend):
    weights = backend.named_weights(dtype=torch.bfloat16)
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" in weights
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert all(not t.requires_grad and t.dtype == torch.bfloat16 for t in weights.values())
    assert set(weights) == set(load_causal_lm(BUILTIN_MODEL_DIR).state_dict())


def test_save_then_load_restores_weights_optimizer_and_version(backend, tmp_path):
    samples = _samples(backend)
    backend.train_step(samples, [1.0, -1.0])
    backend.save(tmp_path)
    saved = {k: v.clone() for k, v in backend.named_weights().items()}
    next_metrics = backend.train_step(samples, [1.0, -1.0])  # the step a resumed run must repeat exactly

    fresh = TorchBackend(str(BUILTIN_MODEL_DIR), loss=PPO, lr=1e-3)
    fresh.setup()
    fresh.named_weights()  # listed before the load (and kept): it must read what the load wrote
    fresh.load(tmp_path)
    assert fresh.version == 1
    assert all(torch.equal(saved[k], v) for k, v in fresh.named_weights().items())
    assert fresh.train_step(samples, [1.0, -1.0])["loss"] == pytest.approx(next_metrics["loss"], abs=1e-7)
    assert all(torch.allclose(backend.named_weights()[k], v, atol=1e-7) for k, v in fresh.named_weights().items())


def test_misuse_and_bad_input_are_clear_errors(backend, tmp_path):
    with pytest.raises(TypeError, match=r"policies\.losses\.make_loss"):
        TorchBackend(str(BUILTIN_MODEL_DIR), loss="ppo_clip")  # a name, not the loss
    with pytest.raises(RuntimeError, match="setup"):
        TorchBackend(str(BUILTIN_MODEL_DIR), loss=PPO).compute_logprobs([])
    samples = _samples(backend)
    with pytest.raises(ValueError, match="advantages"):
        backend.train_step(samples, [1.0])
    samples[0].rollout_logprobs = [0.0]
    with pytest.raises(ValueError, match="rollout_logprobs"):
        backend.train_step(samples, [1.0, -1.0])
    with pytest.raises(ValueError, match="has no model.safetensors"):
        backend.load(tmp_path)


def test_decoupled_ppo_accepts_proximal_logprobs_from_compute_logprobs():
    runs = []
    for pass_proximal in (False, True):
        b = TorchBackend(str(BUILTIN_MODEL_DIR), lr=1e-3, loss=make_loss("decoupled_ppo"))
        b.setup()
        samples = _samples(b)
        for s in samples:  # a stale sampler: behaviour log-probs differ from the trainer's
            s.rollout_logprobs = [lp - 0.1 for lp in s.rollout_logprobs]
        proximal = b.compute_logprobs(samples) if pass_proximal else None
        runs.append(b.train_step(samples, [1.0, -1.0], proximal_logprobs=proximal))
    assert runs[0]["loss"] == pytest.approx(runs[1]["loss"], abs=1e-7)
    assert runs[0]["behav_weight_mean"] == pytest.approx(1.1052, abs=1e-3)  # exp(0.1)


def test_make_backend_builds_the_torch_backend_from_its_config_section_with_its_defaults():
    cfg = TrainerConfig(lr=1e-3)
    backend = make_backend(cfg, str(BUILTIN_MODEL_DIR), seed=3, loss=PPO)
    assert isinstance(backend, TrainerBackend) and isinstance(backend, TorchBackend)
    assert (backend.lr, backend.seed, backend.loss, backend.version) == (1e-3, 3, PPO, 0)
    assert cfg.micro_batch_tokens is None  # resolved per device: 2048 on a CPU
    assert backend.micro_batch_tokens == TorchBackend(str(BUILTIN_MODEL_DIR), loss=PPO).micro_batch_tokens == 2048
    assert backend.shard_specs() is None  # unsharded


def test_make_backend_refuses_a_backend_this_build_lacks_naming_the_key(monkeypatch):
    # whether or not megatron-core is installed here: its package is made absent
    monkeypatch.setattr(backend_registry, "MEGATRON_PACKAGE", "megatron_core_absent_for_this_test")
    with pytest.raises(ValueError, match=r"^trainer\.backend: 'megatron' is not available: this build has no megatron "
                                         r"backend without megatron_core_absent_for_this_test, which is not installed; "
                                         r"install the optional extra: pip install -e \"\.\[megatron\]\"$"):
        make_backend(TrainerConfig(backend="megatron"), str(BUILTIN_MODEL_DIR), seed=0, loss=PPO)
    with pytest.raises(ValueError, match=r"^trainer\.backend: 'jax' is unknown \(expected one of: torch, megatron; "
                                         r"or an import path 'package\.module:attr'\)$"):
        make_backend(TrainerConfig(backend="jax"), str(BUILTIN_MODEL_DIR), seed=0, loss=PPO)


def test_a_backend_named_by_its_import_path_is_built_by_make_backend():
    # what a backend of one's own looks like to the config: its factory's import path
    cfg = TrainerConfig(backend="actors.backends.torch_build:torch_backend")
    assert isinstance(make_backend(cfg, str(BUILTIN_MODEL_DIR), seed=0, loss=PPO), TorchBackend)
    with pytest.raises(ValueError, match=r"^trainer\.backend: 'actors\.backends:Missing': module 'actors\.backends' "
                                         r"has no attribute 'Missing'$"):
        make_backend(TrainerConfig(backend="actors.backends:Missing"), str(BUILTIN_MODEL_DIR), seed=0, loss=PPO)


@pytest.mark.parametrize("loss", ["ppo_clip", "tis_seq"])
def test_token_budget_micro_batches_give_the_same_step_as_one_batch(loss):
    """Sorting a long-tailed batch into micro-batches only removes padding:
    the update equals the whole-batch token-mean step."""
    whole = TorchBackend(BUILTIN_MODEL_DIR, lr=1e-3, loss=make_loss(loss), seed=0, micro_batch_tokens=0)
    micro = TorchBackend(BUILTIN_MODEL_DIR, lr=1e-3, loss=make_loss(loss), seed=0, micro_batch_tokens=24)
    whole.setup()
    micro.setup()
    samples = _samples(whole)
    samples[0].response_ids = samples[0].response_ids * 4  # one long row
    samples[0].rollout_logprobs = samples[0].rollout_logprobs * 4
    advantages = [1.0, -0.5, 0.25, -0.75][: len(samples)] + [0.0] * max(0, len(samples) - 4)
    assert len(micro_batches(samples, micro.micro_batch_tokens)) > 1
    m_whole = whole.train_step(samples, advantages)
    m_micro = micro.train_step(samples, advantages)
    assert m_micro["tokens"] == m_whole["tokens"]
    assert abs(m_micro["grad_norm"] - m_whole["grad_norm"]) < 1e-4 * max(1.0, m_whole["grad_norm"])
    for name, w in whole.named_weights().items():
        torch.testing.assert_close(micro.named_weights()[name], w, atol=1e-5, rtol=1e-4)  # Adam step ~1e-3


def test_the_micro_batch_budget_defaults_by_device_and_refuses_a_negative_one():
    from actors.backends.batching import micro_batch_budget

    assert micro_batch_budget(None, torch.device("cpu")) == 2048
    assert micro_batch_budget(None, torch.device("cuda")) == 16384
    assert micro_batch_budget(0, torch.device("cuda")) == 0
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 0, got -1"):
        TorchBackend(str(BUILTIN_MODEL_DIR), loss=PPO, micro_batch_tokens=-1)


def test_activation_checkpointing_recomputes_each_layer_and_takes_the_same_step():
    """Each decoder layer runs twice per micro-batch (forward, then again in the
    backward pass) and the step is the one without checkpointing (fp32, atol 1e-6)."""
    def step(checkpointing: bool):
        backend = TorchBackend(str(BUILTIN_MODEL_DIR), loss=PPO, lr=1e-3, seed=0, activation_checkpointing=checkpointing)
        backend.setup()
        calls = []
        backend.model.model.layers[0].mlp.act_fn.register_forward_hook(lambda *_: calls.append(1))  # inside the layer
        samples = _samples(backend)
        calls.clear()
        metrics = backend.train_step(samples, [1.0, -1.0])
        return len(calls), metrics, {k: v.clone() for k, v in backend.named_weights().items()}

    (n_plain, m_plain, w_plain), (n_ckpt, m_ckpt, w_ckpt) = step(False), step(True)
    assert (n_plain, n_ckpt) == (1, 2)
    assert m_ckpt["loss"] == pytest.approx(m_plain["loss"], abs=1e-6)
    for name, t in w_plain.items():
        assert torch.allclose(w_ckpt[name], t, atol=1e-6), name


def test_activation_checkpointing_is_refused_by_the_megatron_backend():
    with pytest.raises(ValueError, match=r"^activation_checkpointing must be false with backend 'megatron'"):
        TrainerConfig(backend="megatron", device="cuda", activation_checkpointing=True)
