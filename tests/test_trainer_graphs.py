"""trainer.cuda_graphs: the torch backend's packed training passes replayed as CUDA graphs.

On a CPU: the padded fixed-shape row a graph runs on gives the unpadded row's log-probs and
entropy exactly (pad sequences and empty ones change nothing), and the setting is refused, in
one line, where it cannot run. On a GPU (marked ``gpu``): graphed steps, one micro-batch or
several, train as eager steps do, batch after batch, with a graph captured once per bucket."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from actors.backends import TrainerConfig
from actors.backends.graphs import (BUCKET_TOKENS, CAPTURE_COST_TOKENS, PAD_PIECE, bucket_shape, max_len_bound, own_bucket,
                                    pick_bucket)
from actors.backends.packing import packed_batch
from actors.backends.torch_backend import TorchBackend
from actors.config import ConfigError, load_config
from contracts.sample import Sample
from policies.losses import make_loss
from tests.helpers import llama_dirs, samples_for

ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return llama_dirs(tmp_path_factory.mktemp("graph_models"))


def test_bucket_shapes_round_tokens_and_sequences_up():
    samples = samples_for(1000)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    assert bucket_shape(samples) == (BUCKET_TOKENS, 32)
    long = [Sample(uid="x", group_id="g", prompt_ids=[1] * (BUCKET_TOKENS - tokens + 1), response_ids=[2])]
    assert bucket_shape(samples + long)[0] == 2 * BUCKET_TOKENS
    assert [max_len_bound(n) for n in (1, 300, 1024, 1025, 3000)] == [1024, 1024, 1024, 2048, 4096]


def test_a_padded_row_gives_the_unpadded_rows_logprobs(model_dirs):
    b = TorchBackend(model_dirs["float32"], loss=make_loss("ppo_clip"), seed=0)
    b.setup()
    samples = samples_for(b.model.config.vocab_size)
    plain = packed_batch(samples, b.device)
    padded = packed_batch(samples, b.device, pad_to=(300, 12), pad_piece=64)
    n = plain.input_ids.shape[1]
    bounds = padded.cu_seqlens.tolist()
    pad = 300 - n
    pieces = [64] * (pad // 64) + [pad % 64]
    assert padded.input_ids.shape == (1, 300) and len(bounds) == 13 and 0 < pad % 64
    assert bounds[:7] == plain.cu_seqlens.tolist()
    assert [e - s for s, e in zip(bounds[6:], bounds[7:])] == pieces + [0] * (6 - len(pieces))  # empty ones last
    assert padded.position_ids[0, n:n + 64].tolist() == list(range(64))
    assert torch.equal(padded.input_ids[0, :n], plain.input_ids[0]) and not padded.input_ids[0, n:].any()
    assert padded.max_len == 64 and torch.equal(padded.mask, plain.mask)
    with torch.no_grad():
        want = b._packed_forward(plain, plain.pred_positions, plain.targets, True)
        everywhere = torch.arange(300)  # as the graphs run it: every position, the next token its target
        got = b._packed_forward(padded, everywhere, torch.roll(padded.input_ids[0], -1), True)
    torch.testing.assert_close(got.index_select(0, padded.pred_positions), want, atol=1e-5, rtol=0)


def _batch_of(tokens: int, num: int = 64, longest: int = 300) -> list[Sample]:
    """``num`` samples of ``tokens`` tokens in all, the first ``longest`` long."""
    rest = (tokens - longest) // (num - 1)
    lengths = [longest] + [rest] * (num - 2) + [tokens - longest - rest * (num - 2)]
    return [Sample(uid=f"s{i}", group_id="g", prompt_ids=[1] * 10, response_ids=[2] * (n - 10))
            for i, n in enumerate(lengths)]


def test_a_captured_bucket_serves_a_smaller_batch_until_its_padding_has_paid_for_a_capture():
    captured = {own_bucket(_batch_of(17_000))}  # (18432, 96, 1024)
    wasted: Counter = Counter()
    small = _batch_of(15_000)
    own = own_bucket(small)
    assert own == (16_384, 96, 1024)
    uses = -(-CAPTURE_COST_TOKENS // (18_432 - 16_384))  # 2048 tokens beyond its own bucket a use
    for _ in range(uses):
        key, piece = pick_bucket(small, captured, wasted)
        assert key == (18_432, 96, 1024) and piece == 128  # 3432 pad tokens in 27 pieces of 32 free rows
        batch = packed_batch(small, torch.device("cpu"), pad_to=key[:2], pad_piece=piece)
        assert batch.input_ids.shape == (1, 18_432) and batch.cu_seqlens.shape == (97,)
    assert wasted[own] >= CAPTURE_COST_TOKENS
    assert pick_bucket(small, captured, wasted) == (own, PAD_PIECE)  # paid for: its own graphs now
    # a step's leftover micro-batch (a few samples) runs in the big bucket: 17,932 pad tokens in 93 rows
    leftover = _batch_of(500, num=3, longest=300)
    assert pick_bucket(leftover, captured, Counter()) == ((18_432, 96, 1024), 193)
    # nothing captured holds it (too many tokens, or a longer sequence than the bound): its own
    assert pick_bucket(_batch_of(19_000), captured, Counter())[0] == (20_480, 96, 1024)
    assert pick_bucket(_batch_of(15_000, longest=1500), captured, Counter())[0] == (16_384, 96, 2048)
    # few free rows: the pad pieces grow (up to the bound) so that they fit
    few = _batch_of(15_000, num=90)
    key, piece = pick_bucket(few, captured, Counter())
    assert key == (18_432, 96, 1024) and piece == -(-(18_432 - 15_000) // 6) == 572
    assert packed_batch(few, torch.device("cpu"), pad_to=key[:2], pad_piece=piece).input_ids.shape == (1, 18_432)
    assert pick_bucket(_batch_of(15_000, num=94), captured, Counter())[0] == (16_384, 128, 1024)  # 2 rows: too few
    # the smallest captured bucket that holds it
    assert pick_bucket(small, captured | {(24_576, 96, 1024)}, Counter())[0] == (18_432, 96, 1024)


def test_a_row_that_does_not_fit_its_padding_is_refused():
    samples = samples_for(1000)
    with pytest.raises(ValueError, match=r"^6 samples of \d+ tokens do not fit pad_to=\(10, 32\)$"):
        packed_batch(samples, torch.device("cpu"), pad_to=(10, 32))


@pytest.mark.parametrize(("overrides", "line"), [
    (["trainer.cuda_graphs=true"], "must be false unless device is cuda and dtype bfloat16 (the varlen flash "
                                   "attention); got device 'cpu', dtype 'float32'"),
    (["trainer.cuda_graphs=true", "trainer.device=cuda", "trainer.dtype=bfloat16", "trainer.compile=true"],
     "must be false with compile true (the compiled packed attention reads sequence bounds on the host, "
     "which a graph would freeze); choose one"),
    (["trainer.cuda_graphs=true", "trainer.device=cuda", "trainer.dtype=bfloat16", "trainer.packed=false"],
     "must be false with packed false or activation_checkpointing true"),
])
def test_cuda_graphs_are_refused_at_load_where_they_cannot_run(overrides, line):
    with pytest.raises(ConfigError, match="^" + re.escape("trainer.cuda_graphs: " + line) + "$"):
        load_config(None, overrides)
    assert load_config(None, []).trainer.cuda_graphs is False


def test_a_backend_built_in_code_refuses_graphs_on_a_cpu(model_dirs):
    b = TorchBackend(model_dirs["float32"], loss=make_loss("ppo_clip"), cuda_graphs=True)
    with pytest.raises(ValueError, match=r"^trainer\.cuda_graphs: needs trainer\.device=cuda \(got 'cpu'\)$"):
        b.setup()
    assert TrainerConfig(cuda_graphs=True, device="cuda", dtype="bfloat16").cuda_graphs


def _steps(path: str, graphs: bool, micro_batch_tokens: int, kernels: str = "eager"):
    b = TorchBackend(path, loss=make_loss("ppo_clip"), lr=1e-4, seed=0, device="cuda", dtype="bfloat16",
                     master_dtype="float32", micro_batch_tokens=micro_batch_tokens, cuda_graphs=graphs,
                     kernels=kernels)
    b.setup()
    out = []
    for step in range(3):  # a new batch each step, of other lengths: the graphs replay new inputs
        samples = samples_for(b.model.config.vocab_size, seed=step, num=6 + 2 * step)
        lps = b.compute_logprobs(samples)
        for s, row in zip(samples, lps):
            s.rollout_logprobs = [lp - 0.05 for lp in row]
        out.append((lps, b.train_step(samples, (ADVANTAGES * 2)[: len(samples)])))
    out.append((b.compute_logprobs(samples_for(b.model.config.vocab_size, seed=9)), {}))
    return b, out


@pytest.mark.gpu
@pytest.mark.parametrize("micro_batch_tokens", [0, 40])  # one pass; several, gradients added up
def test_graphed_steps_train_as_eager_steps(model_dirs, micro_batch_tokens):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA device")
    graphed, got = _steps(model_dirs["bfloat16"], True, micro_batch_tokens)
    _, want = _steps(model_dirs["bfloat16"], False, micro_batch_tokens)
    assert len(graphed._graphs.graphs) >= 1 and got[0][1]["cuda_graphs"] >= 1
    for (lps_g, m_g), (lps_e, m_e) in zip(got, want):  # the last: log-probs after three steps
        for a, b in zip(lps_g, lps_e):
            assert a == pytest.approx(b, abs=2e-2)
        for key in ("loss", "entropy", "ratio_mean", "grad_norm"):
            if key in m_e:
                assert m_g[key] == pytest.approx(m_e[key], rel=2e-2, abs=1e-3), key


@pytest.mark.gpu
def test_graphs_run_with_liger_kernels(model_dirs):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA device")
    pytest.importorskip("liger_kernel.transformers")
    _, got = _steps(model_dirs["bfloat16"], True, 0, kernels="liger")
    _, want = _steps(model_dirs["bfloat16"], False, 0, kernels="liger")
    for (lps_g, m_g), (lps_e, m_e) in zip(got, want):
        for a, b in zip(lps_g, lps_e):
            assert a == pytest.approx(b, abs=2e-2)
        if m_e:
            assert m_g["grad_norm"] == pytest.approx(m_e["grad_norm"], rel=2e-2)


def _long_batch(num: int, vocab: int, seed: int) -> list[Sample]:
    """``num`` samples of 60 tokens (the tiny Llama's positions stop at 64)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (num, 60), generator=g).tolist()
    return [Sample(uid=f"l{seed}-{i}", group_id=f"g{i // 2}", prompt_ids=[1, *row[:19]], response_ids=row[20:],
                   rollout_logprobs=[-3.0] * 40) for i, row in enumerate(ids)]


@pytest.mark.gpu
def test_a_batch_run_in_a_bigger_captured_bucket_trains_as_eager(model_dirs):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA device")
    out = {}
    for graphs in (True, False):
        b = TorchBackend(model_dirs["bfloat16"], loss=make_loss("ppo_clip"), lr=1e-4, seed=0, device="cuda",
                         dtype="bfloat16", master_dtype="float32", cuda_graphs=graphs, micro_batch_tokens=0)
        b.setup()
        vocab = b.model.config.vocab_size
        # 16,800 tokens: bucket (18432, 320, 1024) captured; then 15,000 (own bucket 16384) run in it
        steps = [b.train_step(batch, [1.0, -1.0] * (len(batch) // 2)) for batch in
                 (_long_batch(280, vocab, 0), _long_batch(250, vocab, 1))]
        out[graphs] = steps, b.compute_logprobs(_long_batch(250, vocab, 2))
    (got, lps_g), (want, lps_e) = out[True], out[False]
    assert got[1]["cuda_graphs"] == 1 and got[1]["cuda_graph_reuses"] == 1
    for m_g, m_e in zip(got, want):
        assert m_g["grad_norm"] == pytest.approx(m_e["grad_norm"], rel=2e-2)
    for a, b in zip(lps_g, lps_e):
        assert a == pytest.approx(b, abs=2e-2)
