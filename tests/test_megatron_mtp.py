"""Multi-token prediction in the megatron backend (megatron-core's MTP block; docs/mtp.md):
on CPU, megatron-core's real modules against the torch backend (where megatron-core is
installed), and on a GPU a few steps of the tiny model (``gpu`` marker). The name and
shape maps alone are in tests/test_megatron_convert.py."""

from __future__ import annotations

import pytest
import torch

from actors.backends.torch_backend import TorchBackend
from policies.losses import make_loss
from tests.extras import needs_mark
from tests.helpers import samples_for, save_model
from tests.test_megatron_backend import _compare_weights, megatron_on_cpu

PPO = make_loss("ppo_clip")
needs_megatron = needs_mark("megatron.core", "megatron")


def _batch(vocab: int = 37, num: int = 6) -> list:
    batch = samples_for(vocab, num=num)
    for s in batch:
        s.rollout_logprobs = [-1.0] * len(s.response_ids)
    return batch


def test_more_than_one_mtp_module_is_refused_on_megatron_in_one_line():
    from actors.backends.megatron_mtp import mtp_unsupported

    assert mtp_unsupported(1) is None and mtp_unsupported(0) is None
    why = mtp_unsupported(2)
    assert why is not None and "\n" not in why
    assert why.startswith("model.mtp_layers: 2 needs backend: torch; megatron-core's MTP feeds module k + 1")



def test_a_detached_mtp_loss_is_refused_on_megatron_in_one_line():
    from actors.backends import TrainerConfig
    from actors.backends.megatron_backend import MegatronBackend

    cfg = TrainerConfig(backend="megatron", device="cuda")
    with pytest.raises(ValueError, match=r"^trainer.mtp_detach: true needs backend: torch .*set trainer.mtp_detach: false$"):
        MegatronBackend.from_config(cfg, "unused", seed=0, loss=PPO, mtp_layers=1)

@needs_megatron
@pytest.mark.timeout(180)
def test_megatron_mtp_on_cpu_starts_and_steps_as_the_torch_backend(tmp_path):
    """megatron-core's MTP block with the spec's start: the same mtp.0.* weights as the torch
    backend's, the same policy log-probs, the same MTP loss and accuracy, and the same weights
    after a step (plain Adam, lr 1e-3, fp32; all but 0.01 % within 2e-5); over more steps on one batch its loss falls."""
    from actors.backends.megatron_backend import MegatronBackend

    path = save_model("qwen2", tmp_path / "m")
    with megatron_on_cpu():
        with pytest.raises(ValueError, match=r"^model\.mtp_layers: 2 needs backend: torch"):
            MegatronBackend(str(path), loss=PPO, device="cpu", mtp_layers=2)
        kw = dict(loss=PPO, device="cpu", dtype="float32", lr=1e-3, mtp_layers=1, mtp_loss_weight=0.5,
                  micro_batch_tokens=40)
        meg = MegatronBackend(str(path), distributed_optimizer=False, **kw)
        meg.setup()
        ref = TorchBackend(str(path), packed=False, **kw)
        ref.setup()
        w_meg, w_ref = meg.named_weights(), ref.named_weights()
        assert {n: tuple(t.shape) for n, t in w_meg.items()} == {n: tuple(t.shape) for n, t in w_ref.items()}
        for name, t in w_ref.items():
            if name.startswith("mtp."):
                assert torch.equal(w_meg[name], t), name
        batch = _batch()
        for a, b in zip(meg.compute_logprobs(batch), ref.compute_logprobs(batch)):
            assert a == pytest.approx(b, abs=2e-5)
        before = {k: v.clone() for k, v in w_ref.items()}
        adv = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]
        m_meg, m_ref = meg.train_step(batch, adv), ref.train_step(batch, adv)
        for key in ("loss", "mtp/loss_0", "mtp/acc_0", "grad_norm"):
            assert m_meg[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-5), key
        # Adam's step turns an fp32-noise difference of a ~1e-9 gradient into up to ~1e-4: a few elements
        _compare_weights(meg.named_weights(), ref.named_weights(), before, atol=2e-5, max_frac=1e-4,
                         what="an fp32 step with the MTP loss on CPU")
        losses = [meg.train_step(batch, [0.0] * len(batch))["mtp/loss_0"] for _ in range(15)]
        assert losses[-1] < 0.8 * losses[0], losses
        meg.save(tmp_path / "ckpt")
        back = TorchBackend(str(path), packed=False, **kw)
        back.setup()
        back.load(tmp_path / "ckpt")  # the torch backend resumes megatron's MTP weights and moments
        for name, t in meg.named_weights().items():
            assert torch.equal(back.named_weights()[name], t), name


@pytest.mark.gpu
@needs_megatron
@pytest.mark.timeout(300)
def test_gpu_megatron_mtp_reports_a_falling_loss_and_pushes_the_torch_layout(tmp_path):
    """The tiny Qwen2 with model.mtp_layers 1 on the megatron backend (distributed optimizer,
    bf16): a few steps with advantages 0 (only the MTP loss has a gradient) report mtp/loss_0
    and mtp/acc_0 and the loss falls; named_weights() carries mtp.0.* in the torch backend's
    names and shapes, equal to its weights at the start (both from the spec's start)."""
    from actors.backends.megatron_backend import MegatronBackend

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = save_model("qwen2", tmp_path / "m", dtype=torch.float32)
    kw = dict(loss=PPO, device="cuda", dtype="bfloat16", lr=3e-3, mtp_layers=1, mtp_loss_weight=1.0)
    meg = MegatronBackend(str(path), **kw)
    meg.setup()
    ref = TorchBackend(str(path), **kw)
    ref.setup()
    w_meg, w_ref = meg.named_weights(), ref.named_weights()
    mtp_names = sorted(n for n in w_ref if n.startswith("mtp."))
    assert mtp_names and sorted(n for n in w_meg if n.startswith("mtp.")) == mtp_names
    for name in mtp_names:
        assert w_meg[name].shape == w_ref[name].shape and w_meg[name].dtype == w_ref[name].dtype, name
        assert torch.equal(w_meg[name], w_ref[name]), name
    batch = _batch(num=8)
    metrics = [meg.train_step(batch, [0.0] * len(batch)) for _ in range(12)]
    assert all("mtp/loss_0" in m and "mtp/acc_0" in m for m in metrics)
    first, last = metrics[0]["mtp/loss_0"], metrics[-1]["mtp/loss_0"]
    assert last < 0.8 * first, [m["mtp/loss_0"] for m in metrics]
    assert metrics[-1]["mtp/acc_0"] >= metrics[0]["mtp/acc_0"]
    moved = meg.named_weights()
    assert not torch.equal(moved["mtp.0.eh_proj.weight"].cpu(), w_ref["mtp.0.eh_proj.weight"].cpu())
