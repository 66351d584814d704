"""The torch trainer's step keeps the launch queue full: it reads the device once, at its
end; a micro-batch's host inputs go over in one copy; the mixed-precision optimizer casts
and writes back with multi-tensor copies. The numbers stay those of the plain code."""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from actors.backends.batching import _one_copy, to_device
from actors.backends.loss_pass import PassMetrics
from actors.backends.mixed_precision import MainParamsOptimizer
from actors.backends.torch_backend import TorchBackend
from contracts.sample import Sample
from policies.losses import Loss
from tests.helpers import save_model, samples_for

pytestmark = pytest.mark.timeout(120)

ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]


def _pg_with_tensor_metrics(logprobs, rollout_logprobs, advantages, mask, *, proximal_logprobs=None):
    """Policy gradient whose metric stays a 0-d tensor (``policies.losses`` returns floats:
    one device read each)."""
    mask = mask.to(logprobs.dtype)
    num_tokens = mask.sum().clamp(min=1)
    loss = -(advantages[:, None] * logprobs * mask).sum() / num_tokens
    ratio_mean = (torch.exp(logprobs.detach() - rollout_logprobs) * mask).sum() / num_tokens
    return loss, {"ratio_mean": ratio_mean}


TENSOR_METRICS_LOSS = Loss(name="pg_tensor_metrics", fn=_pg_with_tensor_metrics)


class _DispatchedReads(TorchDispatchMode):
    """Counts the dispatched ops that read a tensor's values on the host."""

    READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive"})

    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.READS:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _device_reads() -> Iterator[collections.Counter]:
    """Counts, while open, what would wait for the device on CUDA: item / float / bool,
    nonzero and friends (dispatched), and tolist / cpu / numpy (which a CPU tensor
    answers without dispatching)."""
    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def counted(name):
        def method(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return method

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _DispatchedReads(counts):
            yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(save_model("llama", tmp_path_factory.mktemp("overheads") / "llama"))


def _backend_and_samples(path: str, packed: bool, **kw) -> tuple[TorchBackend, list[Sample]]:
    backend = TorchBackend(path, loss=TENSOR_METRICS_LOSS, lr=1e-4, seed=0, packed=packed, **kw)
    backend.setup()
    if backend.device.type == "cpu":  # as on CUDA (fused there): torch's CPU AdamW reads each step count
        backend.optimizer = torch.optim.AdamW(backend.model.parameters(), lr=1e-4, fused=True)
    samples = samples_for(backend.model.config.vocab_size)
    for s, lps in zip(samples, backend.compute_logprobs(samples)):
        s.rollout_logprobs = [lp - 0.05 for lp in lps]
    return backend, samples


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("micro_batch_tokens", [0, 24])
def test_a_train_step_reads_the_device_once_after_its_last_launch(llama_dir, packed, micro_batch_tokens):
    backend, samples = _backend_and_samples(llama_dir, packed, micro_batch_tokens=micro_batch_tokens)
    backend.train_step(samples, ADVANTAGES)
    with _device_reads() as reads:
        metrics = backend.train_step(samples, ADVANTAGES)
    assert reads == {"tolist": 1}  # metrics and grad norm together; no bounds per layer, no mask count
    assert set(metrics) == {"loss", "entropy", "ratio_mean", "grad_norm", "tokens", "version"}
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize("packed", [True, False])
def test_compute_logprobs_reads_the_device_once(llama_dir, packed):
    backend, samples = _backend_and_samples(llama_dir, packed)
    with _device_reads() as reads:
        logprobs = backend.compute_logprobs(samples)
    assert reads == {"tolist": 1}
    assert [len(row) for row in logprobs] == [len(s.response_ids) for s in samples]


def test_pass_metrics_read_the_sums_a_float_per_pass_gave():
    g = torch.Generator().manual_seed(0)
    passes = [({"loss": torch.rand((), generator=g), "entropy": torch.rand((), generator=g), "clip_frac": 0.25}, w)
              for w in (0.3, 0.5, 0.2)]
    metrics = PassMetrics()
    metrics.name(["loss", "entropy", "clip_frac", "named_only"])  # a weight-0 pass first
    for values, weight in passes:
        metrics.add(values, weight)
    want = dict.fromkeys(["seeded", "loss", "entropy", "clip_frac", "named_only"], 0.0)
    for values, weight in passes:
        for k, v in values.items():
            want[k] = want[k] + float(v) * weight
    grad_norm = torch.tensor(1.5, dtype=torch.bfloat16)
    got = metrics.read(dict.fromkeys(["seeded"], 0.0), grad_norm=grad_norm, tokens=7.0)
    assert got == {**want, "grad_norm": 1.5, "tokens": 7.0}  # bit for bit, in this key order
    assert list(got) == [*want, "grad_norm", "tokens"]


def test_to_device_moves_every_array_through_one_buffer():
    arrays = [np.arange(5), np.ones((2, 3), np.float32), np.zeros(0, np.int32), np.arange(3, dtype=np.int32),
              np.zeros((2, 0), np.float32)]
    staged = _one_copy(arrays, torch.device("cpu"))
    for a, t in zip(arrays, staged):
        assert (t.dtype, tuple(t.shape), t.tolist()) == (torch.from_numpy(a).dtype, a.shape, a.tolist())
    assert len({t.untyped_storage().data_ptr() for t in staged}) == 1
    assert all(t.storage_offset() * t.element_size() % 8 == 0 for t in staged)
    on_cpu = to_device(arrays, torch.device("cpu"))  # no copy at all
    assert [t.tolist() for t in on_cpu] == [a.tolist() for a in arrays]


def test_main_params_step_those_with_grads_in_one_buffer_and_free_the_model_grads():
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(*shape, generator=g) * 0.02 for shape in ((4, 3), (5,), (2, 2))]
    params = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in init]
    ref = [torch.nn.Parameter(t.to(torch.bfloat16).float()) for t in init[:2]]
    opt = MainParamsOptimizer(params, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    ref_opt = torch.optim.AdamW(ref, lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        for p, r in zip(params, ref):  # the last param gets no grad: the step leaves it alone
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            r.grad = p.grad.float()
        norm = opt.clip_and_step(0.5)
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        ref_opt.step()
        assert torch.equal(norm, want)
        assert all(p.grad is None for p in params)
        assert torch.equal(opt.main[0], ref[0].detach()) and torch.equal(opt.main[1], ref[1].detach())
        assert torch.equal(params[0].detach(), ref[0].detach().to(torch.bfloat16))
    assert torch.equal(opt.main[2], params[2].detach().float()) and opt.main[2].grad is None
    assert opt.main[2] not in opt.optimizer.state
    assert opt.main[0].grad.untyped_storage().data_ptr() == opt.main[1].grad.untyped_storage().data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_packed_bf16_step_synchronizes_once(tmp_path):
    """torch's sync debug mode flags every call that waits for the device: one, the read of
    the metrics and grad norm after the optimizer step has been launched."""
    path = save_model("llama", tmp_path / "llama")
    backend, samples = _backend_and_samples(str(path), True, device="cuda", dtype="bfloat16", master_dtype="float32")
    backend.train_step(samples, ADVANTAGES)  # the first creates AdamW's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend.train_step(samples, ADVANTAGES)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
