"""Batched sampling: the counter-based Gumbel draw follows the filtered
softmax, top-k / top-p keep what Hugging Face keeps, seeds reproduce."""

from __future__ import annotations

import pytest
import torch
import transformers

from actors.engines.sampling import SamplingBatch, filter_logits, gumbel_noise, sample
from tests.helpers import needs_triton, run_in_triton_interpreter


def _batch(n: int, temperature=1.0, top_k=0, top_p=1.0, seed=0) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p), seed=torch.arange(n, dtype=torch.int64) + seed,
        needs_filter=top_k > 0 or top_p < 1.0)


def test_draws_follow_the_softmax_over_many_seeds():
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 2
    n = 20000
    token, _, _ = sample(logits.expand(n, 8).contiguous(), _batch(n), torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(token, minlength=8).float() / n
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.015, rtol=0)


def test_noise_depends_on_seed_and_position_only():
    a = gumbel_noise(torch.tensor([5, 6]), torch.tensor([3, 3]), 50)
    b = gumbel_noise(torch.tensor([6, 5]), torch.tensor([3, 3]), 50)
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])
    assert not torch.equal(a[0], gumbel_noise(torch.tensor([5]), torch.tensor([4]), 50)[0])


def test_top_k_and_top_p_keep_what_hugging_face_keeps():
    torch.manual_seed(1)
    logits = torch.randn(6, 40) * 3
    for k, p in ((5, 1.0), (0, 0.7), (10, 0.5), (1, 0.9)):
        ours = filter_logits(logits, torch.full((6,), k), torch.full((6,), p))
        procs = [transformers.TopKLogitsWarper(k)] if k else []
        procs += [transformers.TopPLogitsWarper(p)] if p < 1 else []
        theirs = transformers.LogitsProcessorList(procs)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (k, p)


def test_greedy_rows_take_the_argmax_and_report_raw_logprobs():
    logits = torch.randn(3, 20)
    token, lp, raw = sample(logits, _batch(3, temperature=0.0), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(token, logits.argmax(-1))
    torch.testing.assert_close(lp, raw)
    torch.testing.assert_close(raw, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1))


def test_unseeded_unit_temperature_draws_follow_the_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 2
    n = 20000
    params = _batch(n)
    params.any_greedy, params.unit_temperature = False, True
    params.generator = torch.Generator().manual_seed(3)
    token, lp, raw = sample(logits.expand(n, 8).contiguous(), params, torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(token, minlength=8).float() / n
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.015, rtol=0)
    torch.testing.assert_close(raw, logits.log_softmax(-1)[0][token])
    assert torch.equal(lp, raw)


def check_kernel_greedy_rows(device: str) -> None:
    """The fused sampling kernel on a batch mixing greedy and sampled rows: a greedy row
    takes the argmax (the smallest index on a tie, as torch.argmax and the eager sampler)
    with logprob = raw logprob; sampled rows keep following softmax(x / T). Run on CUDA
    (tests/test_triton_kernels.py) and in Triton's interpreter on the CPU (below)."""
    from actors.engines import triton_kernels as tk

    torch.manual_seed(0)
    logits = (torch.randn(6, 5000) * 2).to(torch.bfloat16).to(device)
    for r in (0, 3):  # ties at the top: the kernel's pieces and lanes must agree on the first
        logits[r, [4321, 17, 2500]] = (logits[r].float().max() + 1).to(logits.dtype)
    temp = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.0, 0.0], device=device)
    token, lp, raw = tk.sample_gumbel(logits, temp, False, torch.Generator(device=device).manual_seed(0))
    greedy = temp <= 0
    x = logits.float()
    assert torch.equal(token[greedy], x[greedy].argmax(-1)) and token[0].item() == token[3].item() == 17
    assert (raw - torch.log_softmax(x, -1).gather(-1, token[:, None]).squeeze(-1)).abs().max().item() < 1e-5
    assert torch.equal(lp[greedy], raw[greedy])
    scaled = torch.log_softmax(x / torch.where(greedy, 1.0, temp)[:, None], -1)
    assert (lp - scaled.gather(-1, token[:, None]).squeeze(-1)).abs().max().item() < 1e-5
    n, v = 4000, 40  # every other row greedy: the sampled ones still follow the softmax
    base = (torch.randn(v) * 2).to(device)
    temp = torch.tensor([1.0, 0.0] * (n // 2), device=device)
    token, _, _ = tk.sample_gumbel(base.repeat(n, 1), temp, False, torch.Generator(device=device).manual_seed(1))
    assert torch.all(token[1::2] == base.argmax())
    freq = torch.bincount(token[0::2], minlength=v).float() / (n // 2)
    p = torch.softmax(base, -1)
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / (n // 2)).sqrt() + 1e-3).all()


@pytest.mark.slow  # ~2 min in the interpreter
@needs_triton
def test_the_sampling_kernel_takes_greedy_rows_in_the_interpreter():
    run_in_triton_interpreter("from tests.test_engine_sampling import check_kernel_greedy_rows; "
                              "check_kernel_greedy_rows('cpu')")
