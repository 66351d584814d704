"""The Triton RMSNorm of ``trainer.kernels: liger`` (actors/backends/norm_kernels.py) computes what
Hugging Face's eager LlamaRMSNorm and torch's autograd of it compute: y, dx and dW, in fp32 and bf16,
on a CUDA device (marked ``gpu``) and, fp32 only, in Triton's interpreter on the CPU; and patching
leaves a model without CUDA as it was."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import hf_model, needs_triton, run_in_triton_interpreter

# rows not a multiple of any BLOCK_M (111, 600, 645), H a power of 2's neighbour (576, 896)
SHAPES = [((3, 37, 576), torch.float32), ((2, 300, 896), torch.float32), ((5, 129, 576), torch.bfloat16)]


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, as transformers writes it."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _run(norm, x: torch.Tensor, weight: torch.Tensor, upstream: torch.Tensor, eps: float):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = norm(x, weight, eps)
    y.backward(upstream)
    return y.detach(), x.grad, weight.grad


def check_rms_norm_against_eager(device: str, fp32_only: bool = False) -> None:
    """y, dx and dW of :func:`rms_norm` against eager's on :data:`SHAPES` (only the fp32 ones with
    ``fp32_only``); then that an eps 100x off is caught, on rows of small variance."""
    from actors.backends.norm_kernels import rms_norm

    g = torch.Generator().manual_seed(0)
    for shape, dtype in SHAPES:
        if fp32_only and dtype != torch.float32:
            continue
        x = (torch.randn(shape, generator=g) * 3).to(device, dtype)
        weight = (torch.randn(shape[-1], generator=g) * 0.2 + 1).to(device, dtype)
        upstream = torch.randn(shape, generator=g).to(device, dtype)
        y, dx, dw = _run(rms_norm, x, weight, upstream, 1e-6)
        want_y, want_dx, want_dw = _run(eager_rms_norm, x, weight, upstream, 1e-6)
        if dtype == torch.float32:
            torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(dx, want_dx, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(dw, want_dw, atol=1e-5 * want_dw.abs().max().item(), rtol=1e-5)
        else:  # y: rstd may differ in fp32's last bit, so x_hat or y by one bf16 ulp (2^-8 of the value)
            ulp = torch.finfo(dtype).eps * want_y.float().abs()
            assert ((y.float() - want_y.float()).abs() <= ulp).all()
            assert (y == want_y).float().mean() > 0.99
            torch.testing.assert_close(dx, want_dx, atol=2e-2, rtol=2e-2)
            # eager rounds each dy * x_hat to bf16 before summing the 645 rows; here the sum is fp32
            torch.testing.assert_close(dw, want_dw, atol=2e-2 * want_dw.abs().max().item(), rtol=2e-2)
    x = (torch.randn(4, 7, 576, generator=g) * 1e-3).to(device)  # variance 1e-6: eps matters
    weight = torch.ones(576, device=device)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(rms_norm(x, weight, 1e-6), eager_rms_norm(x, weight, 1e-4), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_the_triton_rms_norm_computes_eagers_numbers_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    check_rms_norm_against_eager("cuda")


@pytest.mark.gpu
def test_patching_reroutes_a_cuda_llamas_norms_and_only_those():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from actors.backends.norm_kernels import patch_rms_norms

    model = hf_model("llama").cuda()
    ids = torch.tensor([[1, 5, 9, 3, 7]], device="cuda")
    with torch.no_grad():
        want = model(ids).logits
        assert patch_rms_norms(model) == 5  # 2 layers x 2, and the final norm
        assert patch_rms_norms(model) == 0  # once
        torch.testing.assert_close(model(ids).logits, want, atol=1e-5, rtol=1e-5)
    gemma_style = LlamaRMSNorm(64)
    gemma_style.offset = 1.0  # as Liger's patch marks a Gemma norm
    others = torch.nn.ModuleList([GemmaRMSNorm(64), Olmo2RMSNorm(64), gemma_style]).cuda()
    assert patch_rms_norms(others) == 0


@needs_triton
def test_the_triton_rms_norm_computes_eagers_numbers_in_the_interpreter():
    # fp32 only: the interpreter truncates where a GPU rounds to bf16, so bf16 is for the CUDA test
    run_in_triton_interpreter("from tests.test_norm_kernels import check_rms_norm_against_eager as f; "
                              "f('cpu', fp32_only=True)")


def test_patching_a_model_without_cuda_changes_nothing():
    from actors.backends.norm_kernels import patch_rms_norms

    model = hf_model("llama")
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        before = model(ids).logits
        forwards = [m.forward for m in model.modules()]
        assert patch_rms_norms(model) == 0
        assert [m.forward for m in model.modules()] == forwards
        assert torch.equal(model(ids).logits, before)
