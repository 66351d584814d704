"""Mixed precision (fp32 main params, bf16 model params): the model params are
always the main params rounded, updates too small for bf16 still accumulate,
and a checkpoint resumes the main params exactly."""

from __future__ import annotations

import pytest
import torch

from actors.backends.mixed_precision import MainParamsOptimizer
from actors.backends.torch_backend import TorchBackend
from actors.models import BUILTIN_MODEL_DIR
from contracts.sample import Sample
from policies.losses import make_loss

pytestmark = pytest.mark.timeout(120)


def test_main_params_follow_fp32_adamw_and_model_params_are_them_rounded() -> None:
    g = torch.Generator().manual_seed(0)
    init = torch.randn(1000, generator=g) * 0.02
    model = torch.nn.Parameter(init.to(torch.bfloat16))
    ref = torch.nn.Parameter(init.to(torch.bfloat16).float())  # what the main params start from
    opt = MainParamsOptimizer([model], lambda ps: torch.optim.AdamW(ps, lr=1e-6))
    ref_opt = torch.optim.AdamW([ref], lr=1e-6)
    num_changed = 0
    for _ in range(5):
        grad = torch.randn(1000, generator=g)
        opt.zero_grad()
        model.grad = grad.to(torch.bfloat16)
        ref.grad = grad.to(torch.bfloat16).float()
        before = model.detach().clone()
        opt.clip_and_step(float("inf"))
        ref_opt.step()
        assert torch.equal(opt.main[0], ref.detach())
        assert torch.equal(model.detach().view(torch.int16), ref.detach().to(torch.bfloat16).view(torch.int16))
        num_changed += int((model.detach() != before).sum())
    assert 0 < num_changed < 5 * 1000  # some bf16 values move, most steps are below half an ulp


def _samples() -> list[Sample]:
    prompt = [1, 15, 4, 5, 6, 13]
    return [Sample(uid="a", group_id="g", prompt_ids=prompt, response_ids=[6, 5, 4, 2], rollout_logprobs=[-1.0] * 4),
            Sample(uid="b", group_id="g", prompt_ids=prompt, response_ids=[9, 2], rollout_logprobs=[-1.0] * 2)]


def test_bf16_backend_keeps_fp32_main_params_and_checkpoints_them(tmp_path) -> None:
    backend = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss("ppo_clip"), dtype="bfloat16", lr=1e-4, seed=0)
    backend.setup()
    assert isinstance(backend.optimizer, MainParamsOptimizer)
    backend.train_step(_samples(), [1.0, -1.0])
    main = [m.detach().clone() for m in backend.optimizer.main]
    params = list(backend.model.parameters())
    assert all(p.dtype == torch.bfloat16 and torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(params, main))
    backend.save(tmp_path)
    other = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss("ppo_clip"), dtype="bfloat16", lr=1e-4, seed=1)
    other.setup()
    other.load(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(main, other.optimizer.main))
    assert other.version == 1


def test_fp32_backend_steps_the_model_params_directly() -> None:
    backend = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss("ppo_clip"), lr=1e-4)
    backend.setup()
    assert isinstance(backend.optimizer, torch.optim.AdamW)
