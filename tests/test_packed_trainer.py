"""The torch backend's packed path (one row per micro-batch, log-probs from the LM head in
chunks) computes what the padded path computes, on tiny local models."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import transformers

from actors.backends import TrainerConfig, head_kernels, make_backend
from actors.backends.batching import micro_batches
from actors.backends.chunked_logprobs import chunked_logprobs
from actors.backends.packing import packed_attention, packed_batch
from actors.backends.torch_backend import TorchBackend
from contracts.sample import Sample
from policies.losses import make_loss, ppo_clip
from tests.helpers import hf_model, needs_triton, run_in_triton_interpreter, save_model, samples_for

ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """qwen2: a tied head and qkv biases; llama: an lm_head of its own."""
    root = tmp_path_factory.mktemp("packed_models")
    return {kind: str(save_model(kind, root / kind)) for kind in ("qwen2", "llama")}


def _backend(path: str, packed: bool, loss: str = "ppo_clip", **kw) -> TorchBackend:
    b = TorchBackend(path, loss=make_loss(loss), lr=kw.pop("lr", 1e-4), seed=0, packed=packed, **kw)
    b.setup()
    return b


def _samples(backend: TorchBackend) -> list[Sample]:
    """Six samples of different prompt and response lengths, behaviour log-probs a little off-policy."""
    samples = samples_for(backend.model.config.vocab_size)
    for s, lps in zip(samples, backend.compute_logprobs(samples)):
        s.rollout_logprobs = [lp - 0.05 for lp in lps]
    return samples


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_packed_logprobs_equal_padded_logprobs(model_dirs, kind):
    packed, padded = _backend(model_dirs[kind], True), _backend(model_dirs[kind], False)
    assert packed.packed and not padded.packed and packed.padded_reason is None
    samples = samples_for(packed.model.config.vocab_size)
    got, want = packed.compute_logprobs(samples), padded.compute_logprobs(samples)
    assert [len(x) for x in got] == [len(s.response_ids) for s in samples]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("micro_batch_tokens", [0, 24])
@pytest.mark.parametrize("loss", ["ppo_clip", "decoupled_ppo"])
def test_one_train_step_packed_leaves_the_weights_of_the_padded_step(model_dirs, kind, micro_batch_tokens, loss):
    runs = []
    for packed in (True, False):
        b = _backend(model_dirs[kind], packed, loss, micro_batch_tokens=micro_batch_tokens, logprob_chunk_tokens=4)
        samples = _samples(b)
        metrics = b.train_step(samples, ADVANTAGES)
        grads = {n: p.grad.clone() for n, p in b.model.named_parameters()}  # clipped, as stepped
        runs.append((metrics, grads, {n: t.clone() for n, t in b.named_weights().items()}))
    if micro_batch_tokens:  # several passes, packed and padded alike
        assert len(micro_batches(samples, micro_batch_tokens, packed=True)) > 1
        assert len(micro_batches(samples, micro_batch_tokens)) > 1
    (m_packed, g_packed, w_packed), (m_padded, g_padded, w_padded) = runs
    for key in ("loss", "entropy", "ratio_mean", "grad_norm", "tokens"):
        assert m_packed[key] == pytest.approx(m_padded[key], abs=1e-5), key
    for name in g_padded:
        torch.testing.assert_close(g_packed[name], g_padded[name], atol=1e-5, rtol=0, msg=name)
    assert w_packed.keys() == w_padded.keys()
    for name in w_padded:
        torch.testing.assert_close(w_packed[name], w_padded[name], atol=1e-5, rtol=0, msg=name)
    assert not torch.equal(w_packed["model.embed_tokens.weight"], _backend(model_dirs[kind], True)
                           .named_weights()["model.embed_tokens.weight"])  # the step did move the weights


def _plain_padded_step(path: str, samples: list[Sample], advantages: list[float], lr: float,
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
    """The step with nothing of the backend's: the HF model (eager attention) on right-padded
    rows, log_softmax over the full logits, ppo_clip, clip_grad_norm_(1.0), torch's AdamW.
    Returns the weights, the clipped grads and the loss and grad norm."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    num_resp = max(len(s.response_ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    rollout, mask = torch.zeros(len(samples), num_resp), torch.zeros(len(samples), num_resp)
    for i, s in enumerate(samples):
        seq = [*s.prompt_ids, *s.response_ids]
        ids[i, : len(seq)], attn[i, : len(seq)] = torch.tensor(seq), 1
        rollout[i, : len(s.response_ids)], mask[i, : len(s.response_ids)] = torch.tensor(s.rollout_logprobs), 1
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)  # [B, L, V]
    rows = []
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        row = logp[i, p - 1 : p - 1 + n].gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1)
        rows.append(torch.cat([row, row.new_zeros(num_resp - n)]))
    loss, _ = ppo_clip(torch.stack(rows), rollout, torch.tensor(advantages), mask)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return weights, grads, {"loss": loss.item(), "grad_norm": grad_norm.item()}


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("packed", [True, False])
def test_one_train_step_is_a_plain_pytorch_step_on_padded_rows(model_dirs, kind, packed):
    """Pins one step against a reference written without the backend's machinery (packing,
    the chunked head, deferred metrics, multi-tensor casts). Padded: the same weights (1e-6).
    Packed: the same clipped grads (1e-6), so the same step up to AdamW's normalisation of
    near-zero grads, which the packed-equals-padded test bounds at 1e-5."""
    b = _backend(model_dirs[kind], packed, micro_batch_tokens=0, logprob_chunk_tokens=4)
    samples = _samples(b)
    metrics = b.train_step(samples, ADVANTAGES)
    want_weights, want_grads, want_metrics = _plain_padded_step(model_dirs[kind], samples, ADVANTAGES, lr=1e-4)
    for key in ("loss", "grad_norm"):
        assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-6), key
    for name, p in b.model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], atol=1e-6, rtol=0, msg=name)
    if not packed:
        got = b.named_weights()
        assert got.keys() == want_weights.keys()
        for name in want_weights:
            torch.testing.assert_close(got[name], want_weights[name], atol=1e-6, rtol=0, msg=name)


CUDA = pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or head_kernels.triton is None, reason="needs CUDA + Triton")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("fused", [False, True])  # fused: the Triton head on CUDA, the torch path (unchanged) on CPU
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 64])
def test_chunked_logprobs_equal_the_full_log_softmax_and_its_gradients(chunk_tokens, with_bias, fused, device):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=g, dtype=torch.float64).float().to(device).requires_grad_()
    weight = torch.randn(29, 16, generator=g).to(device).requires_grad_()
    bias = torch.randn(29, generator=g).to(device).requires_grad_() if with_bias else None
    targets = torch.randint(0, 29, (7,), generator=g).to(device)
    upstream = torch.randn(7, generator=g).to(device)

    logp, entropy = chunked_logprobs(hidden, weight, bias, targets, chunk_tokens, fused=fused)
    (logp * upstream).sum().backward()
    got = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None

    full = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias), dim=-1)  # [T, V]
    want_logp = full.gather(1, targets[:, None]).squeeze(1)
    (want_logp * upstream).sum().backward()
    want = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])
    torch.testing.assert_close(logp, want_logp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach(), atol=1e-5, rtol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_head_matches_the_torch_head_at_a_real_vocabulary(dtype):
    """SmolLM2's vocabulary (49152) and one not a multiple of the kernels' block, in fp32 and bf16:
    log-probs, entropy and gradients of the fused head against the torch path's."""
    if not torch.cuda.is_available() or head_kernels.triton is None:
        pytest.skip("needs CUDA + Triton")
    for vocab in (49152, 50001):
        g = torch.Generator().manual_seed(vocab)
        hidden = torch.randn(300, 64, generator=g).to("cuda", dtype).requires_grad_()
        weight = (torch.randn(vocab, 64, generator=g) / 4).to("cuda", dtype).requires_grad_()  # logits ~N(0, 4)
        targets = torch.randint(0, vocab, (300,), generator=g).cuda()
        upstream = torch.randn(300, generator=g).cuda()
        runs = []
        for fused in (False, True):
            logp, entropy = chunked_logprobs(hidden, weight, None, targets, 128, fused=fused)
            (logp * upstream).sum().backward()
            runs.append((logp.detach(), entropy, hidden.grad, weight.grad))
            hidden.grad = weight.grad = None
        (want_logp, want_ent, want_gh, want_gw), (logp, ent, gh, gw) = runs
        torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-6)
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1.6e-2}
        torch.testing.assert_close(gh, want_gh, **tol)
        torch.testing.assert_close(gw, want_gw, **tol)


def check_head_kernels_against_torch(device: str) -> None:
    """The head's Triton kernels called directly, fp32, against the torch path's arithmetic:
    lse, log-probs, entropy, and d logits. In Triton's interpreter on the CPU (below; it
    truncates where a GPU rounds, so bf16 is for the CUDA test above)."""
    g = torch.Generator().manual_seed(0)
    for vocab in (4096, 5001):  # one block; three, the last one short
        logits = (torch.randn(6, vocab, generator=g) * 2).to(device)
        targets = torch.randint(0, vocab, (6,), generator=g).to(device)
        lse, logp, entropy = (torch.empty(6, device=device) for _ in range(3))
        head_kernels.logprob_forward(logits, targets, lse, logp, entropy)
        want_lse = torch.logsumexp(logits, -1)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=0)
        torch.testing.assert_close(logp, logits.gather(1, targets[:, None]).squeeze(1) - want_lse, atol=1e-5, rtol=0)
        want_entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=0)
        grad = torch.randn(6, generator=g).to(device)
        d = head_kernels.logprob_backward_(logits.clone(), targets, lse, grad)
        want_d = -(logits - lse[:, None]).exp() * grad[:, None]
        torch.testing.assert_close(d, want_d.scatter_add_(1, targets[:, None], grad[:, None]), atol=1e-6, rtol=0)


@needs_triton
def test_the_head_kernels_compute_the_torch_heads_numbers_in_the_interpreter():
    run_in_triton_interpreter("from tests.test_packed_trainer import check_head_kernels_against_torch as f; f('cpu')")


def test_attention_never_crosses_a_sequence_boundary(model_dirs):
    backend = _backend(model_dirs["llama"], True)
    samples = samples_for(backend.model.config.vocab_size, num=3)
    before = backend.compute_logprobs(samples)
    changed = [Sample(uid="x", group_id="x", prompt_ids=[1, 5, 6, 7, 8, 9, 10, 11],
                      response_ids=[12, 13, 14, 15, 16, 17, 18, 19, 20])] + samples[1:]
    after = backend.compute_logprobs(changed)
    assert after[1:] == before[1:]  # bit for bit: nothing of sequence 1 reaches the others
    alone = backend.compute_logprobs(samples[2:])
    assert alone[0] == pytest.approx(before[2], abs=1e-6)


def test_packed_batch_restarts_positions_and_points_at_the_response_predictors():
    samples = [Sample(uid="a", group_id="g", prompt_ids=[1, 2], response_ids=[3, 4, 5]),
               Sample(uid="b", group_id="g", prompt_ids=[6, 7, 8], response_ids=[9])]
    batch = packed_batch(samples, torch.device("cpu"))
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert batch.cu_seqlens.tolist() == [0, 5, 9] and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_len == 5
    assert batch.pred_positions.tolist() == [1, 2, 3, 7]  # the hidden state before each response token
    assert batch.targets.tolist() == [3, 4, 5, 9]
    assert batch.mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_packed_micro_batches_count_tokens_not_padding():
    samples = [Sample(uid=str(i), group_id="g", prompt_ids=[1] * n, response_ids=[2]) for i, n in
               enumerate([9, 1, 1, 1])]  # lengths 10, 2, 2, 2
    assert micro_batches(samples, 12) == [[1, 2, 3], [0]]  # padded: 4 rows x 10 would not fit
    assert micro_batches(samples, 12, packed=True) == [[1, 2, 3], [0]]
    assert micro_batches(samples, 14, packed=True) == [[1, 2, 3], [0]]
    assert micro_batches(samples, 16, packed=True) == [[1, 2, 3, 0]]
    assert micro_batches(samples, 16) == [[1, 2, 3], [0]]


def test_the_packed_attention_refuses_a_call_without_sequence_lengths():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="cu_seq_lens_q"):
        packed_attention(torch.nn.Module(), q, q, q, None)


def test_a_model_packing_does_not_support_trains_padded_and_says_why(tmp_path, caplog):
    path = tmp_path / "sliding"
    hf_model("qwen2", sliding_window=4, use_sliding_window=True, max_window_layers=0).save_pretrained(path)
    with caplog.at_level(logging.WARNING, logger="actors.backends.torch_backend"):
        backend = _backend(str(path), True)
    assert not backend.packed and "sliding-window" in backend.padded_reason
    assert "trainer.packed" in caplog.text and "trains padded" in caplog.text
    samples = _samples(backend)
    assert backend.train_step(samples, ADVANTAGES)["tokens"] == sum(len(s.response_ids) for s in samples)


def test_the_config_turns_packing_on_by_default_and_passes_its_chunk(model_dirs):
    assert TrainerConfig().packed is True
    backend = make_backend(TrainerConfig(packed=False, logprob_chunk_tokens=5), model_dirs["qwen2"], seed=0,
                           loss=make_loss("ppo_clip"))
    assert (backend.packed, backend.logprob_chunk_tokens) == (False, 5)
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        TorchBackend(model_dirs["qwen2"], loss=make_loss("ppo_clip"), logprob_chunk_tokens=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_on_cuda_packed_matches_padded_with_the_varlen_kernel_or_the_per_sequence_fallback(tmp_path, dtype):
    """bf16: the varlen flash kernel where this torch has it; fp32: one SDPA per sequence."""
    path = save_model("llama", tmp_path / "llama")
    kw = dict(device="cuda", dtype=dtype, master_dtype="float32")
    packed, padded = _backend(str(path), True, **kw), _backend(str(path), False, **kw)
    samples = _samples(padded)
    tol = 5e-2 if dtype == "bfloat16" else 1e-4
    for g, w in zip(packed.compute_logprobs(samples), padded.compute_logprobs(samples)):
        assert g == pytest.approx(w, abs=tol)
    got, want = packed.train_step(samples, ADVANTAGES), padded.train_step(samples, ADVANTAGES)
    assert got["loss"] == pytest.approx(want["loss"], abs=tol) and got["grad_norm"] == pytest.approx(
        want["grad_norm"], rel=tol)


def _fake_varlen(q, k, v, cu_seqlens, max_len, scaling):
    """A fake of :func:`actors.backends.packing._varlen` for the CPU (the flash kernel is CUDA
    only): causal SDPA per sequence over ``[N, H, D]``, GQA included."""
    bounds = cu_seqlens.tolist()
    parts = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                            is_causal=True, scale=scaling, enable_gqa=True).transpose(0, 1)
             for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts)


def test_the_varlen_path_hands_gradients_on_as_views_with_the_per_sequence_numbers(monkeypatch):
    """The CUDA path's layout handling (``_varlen_packed``) over a fake kernel on the CPU: the
    per-sequence path's output and gradients, and no select between q and the kernel (its
    backward would copy each gradient into a zeroed [1, H, N, D] tensor); the real kernel runs in
    the CUDA test above."""
    from actors.backends import packing

    monkeypatch.setattr(packing, "_varlen", _fake_varlen)
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    # [1, H, N, D] views of [1, N, H, D] tensors, as Hugging Face's attention passes them
    q, k, v = (torch.randn(1, 16, h, 8, generator=g).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
    out = packing._varlen_packed(q, k, v, cu, 7, 0.3)
    want, _ = packed_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=7)
    torch.testing.assert_close(out, want)
    upstream = torch.randn(out.shape, generator=g)
    got_grads = torch.autograd.grad(out, (q, k, v), upstream)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)
    for got, exp in zip(got_grads, want_grads):
        torch.testing.assert_close(got, exp)
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack += [f for f, _ in fn.next_functions]
    assert "SelectBackward0" not in {type(fn).__name__ for fn in seen}
