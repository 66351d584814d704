"""``trainer.optimizer: muon``: Muon for the 2-D hidden weights, AdamW for the rest.

Against a reference written here from the published algorithms (Keller Jordan's
Muon: momentum, Nesterov, five quintic Newton-Schulz steps in bf16; AdamW with
torch's bias correction), fed the very gradients the backend stepped with.
Measured on the tiny model (fp32 params, lr 1e-3, steps of ~5e-4): the params
after two steps are within 1.3e-7 of the reference (Muon's within 1.2e-8);
checked at 1e-5. The reference's Newton-Schulz rounds as torch's does (each
``b A + c A A`` and ``a X + B X`` one bf16 multiply-add): in bf16 the iteration
is only ~2% accurate on a full-rank matrix, and on these low-rank gradients
(~40 tokens a step, 128-wide matrices) it lifts rounding noise outside the
gradient's span to a fifth of the update, so a reference that rounded
differently (Keller Jordan's ``b * A + c * A @ A``) or ran fp64 lands ~2e-4
away: the arithmetic, not the algorithm. That sensitivity also sets how close
two FSDP2 ranks come to one worker: given the same gradients, bit for bit; trained
on half the batch each, whose gradients differ in the last fp32 bits, within a
few percent of each matrix's update (a shard's orthogonalisation: 60-80%).
"""

from __future__ import annotations

import math
import os
import pathlib
import pickle
import random
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from actors.backends import make_backend
from actors.backends.config import MuonConfig, TrainerConfig
from actors.backends.optimizers import MuonAdamW, muon_mask
from actors.backends.torch_backend import TorchBackend
from actors.config import ConfigError, load_config
from actors.models import BUILTIN_MODEL_DIR
from contracts.sample import Sample
from policies.losses import make_loss
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(180)

ROOT = pathlib.Path(__file__).resolve().parents[1]
LR, WEIGHT_DECAY, BETAS, ADAM_EPS = 1e-3, 0.1, (0.9, 0.999), 1e-8
NUM_STEPS = 2
ATOL = 1e-5
PROMPT_LEN, RESPONSE_LEN = 40, 40


def _batch() -> tuple[list[Sample], list[float]]:
    """Four GRPO groups of two (rank r of two takes groups 2r, 2r+1), stale rollout log-probs."""
    rng = random.Random(0)
    samples, advantages = [], []
    for g in range(4):
        prompt = [1] + [rng.randrange(3, 21) for _ in range(rng.randrange(PROMPT_LEN // 2, PROMPT_LEN))]
        for k in range(2):
            samples.append(Sample(uid=f"g{g}s{k}", group_id=f"g{g}", prompt_ids=prompt, response_ids=[
                rng.randrange(3, 21) for _ in range(rng.randrange(RESPONSE_LEN // 2, RESPONSE_LEN))]))
            advantages.append((1.0 if k == 0 else -1.0) * (0.5 + g / 4))
    for s in samples:
        s.rollout_logprobs = [-3.0 + rng.uniform(-0.1, 0.1) for _ in s.response_ids]
    return samples, advantages


def _backend(adjust_lr: Any = "match_rms_adamw", *, optimizer: str = "muon", **kwargs: Any) -> TorchBackend:
    muon = MuonConfig(adjust_lr=adjust_lr) if optimizer == "muon" else None
    b = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss("ppo_clip"), lr=LR, weight_decay=WEIGHT_DECAY,
                     betas=BETAS, seed=0, micro_batch_tokens=0, muon=muon, **kwargs)
    b.setup()
    return b


# -- the reference: the published algorithms, written out --------------------------------


def _newton_schulz5(g: torch.Tensor, dtype: torch.dtype = torch.bfloat16, steps: int = 5,
                    eps: float = 1e-7) -> torch.Tensor:
    """Keller Jordan's quintic iteration towards the orthogonal factor of ``g``, in
    ``dtype``: X <- a X + (b A + c A A) X with A = X X^T, each bracket one fused
    multiply-add (``addmm``, one rounding, as torch.optim.Muon computes it)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / max(float(x.norm()), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _muon_scale(shape: torch.Size, adjust_lr: str) -> float:
    rows, cols = shape
    if adjust_lr == "original":
        return math.sqrt(max(1.0, rows / cols))
    rms = 0.2 if adjust_lr == "match_rms_adamw" else math.sqrt((1 - BETAS[0]) / (1 + BETAS[0]))
    return rms * math.sqrt(max(rows, cols))


class _Reference:
    """Muon over the 2-D hidden weights, AdamW over the rest, from the papers' pseudo-code."""

    def __init__(self, params: dict[str, torch.Tensor], muon_names: set[str], adjust_lr: str,
                 ns_dtype: torch.dtype = torch.bfloat16):
        self.params = {k: v.detach().clone().double() for k, v in params.items()}
        self.muon_names, self.adjust_lr, self.ns_dtype = muon_names, adjust_lr, ns_dtype
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.t = 0

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        self.t += 1
        for name, p in self.params.items():
            g = grads[name].double()
            p.mul_(1 - LR * WEIGHT_DECAY)  # decoupled weight decay, both optimizers
            if name in self.muon_names:  # Muon's momentum in fp32, as its code keeps it
                m = self.state.setdefault(name, {"m": torch.zeros_like(grads[name])})["m"]
                m.lerp_(grads[name], 1 - 0.95)
                update = _newton_schulz5(grads[name].lerp(m, 0.95), self.ns_dtype).double()
                p.sub_(LR * _muon_scale(p.shape, self.adjust_lr) * update)
            else:
                st = self.state.setdefault(name, {"m": torch.zeros_like(g), "v": torch.zeros_like(g)})
                st["m"].mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
                st["v"].mul_(BETAS[1]).add_(g * g, alpha=1 - BETAS[1])
                m_hat, v_hat = st["m"] / (1 - BETAS[0] ** self.t), st["v"] / (1 - BETAS[1] ** self.t)
                p.sub_(LR * m_hat / (v_hat.sqrt() + ADAM_EPS))


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "match_adamw_update_rms", "original"])
def test_two_steps_match_the_published_muon_and_adamw(adjust_lr):
    samples, advantages = _batch()
    b = _backend(adjust_lr)
    named = dict(b.model.named_parameters())
    ref = _Reference(named, {n for (n, _), m in zip(named.items(), muon_mask(b.model)) if m}, adjust_lr)
    for _ in range(NUM_STEPS):
        b.train_step(samples, advantages)
        ref.step({n: p.grad for n, p in named.items()})  # the clipped grads the step used
        for name, p in named.items():
            torch.testing.assert_close(p.detach().double(), ref.params[name], atol=ATOL, rtol=0, msg=name)
    initial = _backend(adjust_lr).model.state_dict()
    moved = {n: float((p.detach() - initial[n]).abs().max()) for n, p in named.items()}
    assert min(moved.values()) > 10 * ATOL, moved  # every param moved well beyond the tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_in_bf16_the_fp32_main_params_step_as_the_reference():
    """The default GPU setting: bf16 model, fp32 main params (MainParamsOptimizer), fused AdamW."""
    samples, advantages = _batch()
    b = _backend(device="cuda", dtype="bfloat16", master_dtype="float32")
    names = [n for n, _ in b.model.named_parameters()]
    main = dict(zip(names, b.optimizer.main))
    ref = _Reference(main, {n for n, m in zip(names, muon_mask(b.model)) if m}, "match_rms_adamw")
    for _ in range(NUM_STEPS):
        b.train_step(samples, advantages)
        ref.step({n: m.grad for n, m in main.items()})  # the clipped fp32 main grads the step used
        for name, m in main.items():
            torch.testing.assert_close(m.detach().double(), ref.params[name], atol=ATOL, rtol=0, msg=name)
    params = dict(b.model.named_parameters())
    assert all(torch.equal(params[n], m.to(torch.bfloat16)) for n, m in main.items())


def test_muon_takes_the_hidden_matrices_and_adamw_the_embedding_norms_and_biases():
    b = _backend()
    mask = dict(zip([n for n, _ in b.model.named_parameters()], muon_mask(b.model)))
    muon = sorted(n for n, m in mask.items() if m)
    assert muon == sorted(f"model.layers.{i}.{part}.weight" for i in range(2) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    # the embedding is tied to the head: one param, AdamW's
    assert not mask["model.embed_tokens.weight"] and "lm_head.weight" not in mask
    assert isinstance(b.optimizer, MuonAdamW)
    groups = b.optimizer.param_groups
    assert [len(g["params"]) for g in groups] == [14, 12] and groups[0]["adjust_lr_fn"] == "match_rms_adamw"


def _optimizer_tensors(state: dict) -> dict[tuple, torch.Tensor]:
    return {(i, k): v for i, st in state["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(("device", "dtype"), [("cpu", "float32"), ("cpu", "bfloat16"),
                                               pytest.param("cuda", "bfloat16", marks=CUDA)])
def test_a_checkpoint_restores_the_momentum_exactly_and_resumes_the_same_step(tmp_path, device, dtype):
    samples, advantages = _batch()
    b = _backend(device=device, dtype=dtype, master_dtype="float32")
    for _ in range(NUM_STEPS):
        b.train_step(samples, advantages)
    b.save(tmp_path)
    fresh = _backend(device=device, dtype=dtype, master_dtype="float32")
    fresh.load(tmp_path)
    want, got = b.optimizer.state_dict(), fresh.optimizer.state_dict()
    if dtype == "bfloat16":  # MainParamsOptimizer: the fp32 main params, then Muon + AdamW's state
        assert all(torch.equal(x, y) for x, y in zip(want["main_params"], got["main_params"]))
        want, got = want["optimizer"], got["optimizer"]
    tensors = _optimizer_tensors(want)
    assert sum(k == "momentum_buffer" for _, k in tensors) == 14 and tensors.keys() == _optimizer_tensors(got).keys()
    assert all(torch.equal(v, _optimizer_tensors(got)[key]) for key, v in tensors.items())
    assert want["param_groups"] == got["param_groups"]
    b.train_step(samples, advantages)
    fresh.train_step(samples, advantages)
    assert all(torch.equal(x, y) for x, y in zip(b.named_weights().values(), fresh.named_weights().values()))


def test_a_checkpoint_of_another_optimizer_is_refused_by_name(tmp_path):
    samples, advantages = _batch()
    adamw = _backend(optimizer="adamw")
    adamw.train_step(samples, advantages)
    adamw.save(tmp_path / "adamw")
    with pytest.raises(ValueError, match="not a Muon \\+ AdamW one"):
        _backend().load(tmp_path / "adamw")
    muon = _backend()
    muon.train_step(samples, advantages)
    muon.save(tmp_path / "muon")
    with pytest.raises(ValueError, match="parameter groups"):
        _backend(optimizer="adamw").load(tmp_path / "muon")


def test_the_config_builds_muon_and_refuses_it_where_it_cannot_run():
    cfg = load_config(ROOT / "fully_async.yaml", ["trainer.optimizer=muon", "trainer.muon.lr=0.02",
                                                   "trainer.muon.adjust_lr=original"])
    assert cfg.trainer.muon == MuonConfig(lr=0.02, adjust_lr="original")
    b = make_backend(cfg.trainer, str(BUILTIN_MODEL_DIR), seed=0, loss=make_loss("ppo_clip"))
    assert b.muon == cfg.trainer.muon
    assert make_backend(TrainerConfig(), str(BUILTIN_MODEL_DIR), seed=0, loss=make_loss("ppo_clip")).muon is None
    with pytest.raises(ConfigError, match="trainer.optimizer: must be adamw with backend 'megatron'"):
        load_config(ROOT / "fully_async.yaml", ["trainer.optimizer=muon", "trainer.backend=megatron"])
    with pytest.raises(ConfigError, match="trainer.muon.momentum"):
        load_config(ROOT / "fully_async.yaml", ["trainer.optimizer=muon", "trainer.muon.momentum=1.0"])


def test_a_torch_without_muon_gets_a_one_line_error(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ValueError, match=r"^trainer.optimizer: muon is not available here: it needs "
                                         r"torch.optim.Muon \(torch >= 2.9\), and this torch is [^\n]+$"):
        _backend()


# -- two FSDP2 ranks against one worker ----------------------------------------------------


def _full(b: TorchBackend) -> dict[str, torch.Tensor]:
    """Params and Muon momentum buffers, whole (sharded ones gathered on every rank: collective)."""
    whole = (lambda t: t.full_tensor().cpu()) if b.world_size > 1 else (lambda t: t.cpu())
    out = {k: whole(v).clone() for k, v in b.model.state_dict().items()}
    names = [n for n, _ in b.model.named_parameters()]
    for i, st in b.optimizer.state_dict()["state"].items():
        if "momentum_buffer" in st:
            out[f"momentum:{names[i]}"] = whole(st["momentum_buffer"]).clone()
    return out


def _given_grads(b: TorchBackend, step: int) -> dict[str, torch.Tensor]:
    """Set every param's gradient to the same seeded full one at any world size (a rank
    keeps its rows), step the optimizer alone; the params and momentum after."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(step)
    b.optimizer.zero_grad()
    for p in b.model.parameters():
        grad = (torch.randn(tuple(p.shape), generator=gen) * 1e-2).to(p.device)
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
    b.optimizer.step()
    return _full(b)


def _rank(rank: int, world: int, port: int, out_dir: str, device: str) -> None:
    """One of ``world`` trainer ranks: gloo on the CPU, NCCL on ``cuda:<rank>``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        samples, advantages = _batch()
        mine, my_adv = samples[4 * rank : 4 * rank + 4], advantages[4 * rank : 4 * rank + 4]
        b = _backend(device=device)
        assert b.world_size == world and type(b.optimizer.muon).__name__ == "ShardedMuon"
        out: dict[str, Any] = {"given": [_given_grads(b, step) for step in range(NUM_STEPS)]}
        b = _backend(device=device)
        out["steps"] = [(b.train_step(mine, my_adv), _full(b)) for _ in range(NUM_STEPS)]
        b.save(os.path.join(out_dir, "ckpt"))
        fresh = _backend(device=device)
        fresh.load(os.path.join(out_dir, "ckpt"))
        out["reloaded"] = _full(fresh)
        b.train_step(mine, my_adv)
        fresh.train_step(mine, my_adv)
        out["after_resume"] = (_full(b), _full(fresh))
        mixed = _backend(device=device, dtype="bfloat16", master_dtype="float32")  # FSDP2's fp32 params, bf16 compute
        out["mixed"] = (_full(mixed), mixed.train_step(mine, my_adv), _full(mixed))
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")])])
def two_ranks(request, tmp_path_factory):
    """Both ranks' results and the device they ran on (``cuda``: one worker on cuda:0 to compare)."""
    out_dir = tmp_path_factory.mktemp(f"muon_dp_{request.param}")
    mp.spawn(_rank, args=(2, free_port(), str(out_dir), request.param), nprocs=2, join=True)
    ranks = []
    for r in range(2):
        with open(out_dir / f"rank{r}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    return out_dir, ranks, "cpu" if request.param == "cpu" else "cuda:0"


def test_given_the_same_gradients_two_ranks_step_bit_for_bit_like_one_worker(two_ranks):
    _, (r0, r1), device = two_ranks
    one = _backend(device=device)
    for step, (w0, w1) in enumerate(zip(r0["given"], r1["given"])):
        want = _given_grads(one, step)
        assert w0.keys() == want.keys() and sum(k.startswith("momentum:") for k in want) == 14
        for k, v in want.items():
            assert torch.equal(w0[k], w1[k]), k  # both ranks hold one model
            if k.startswith("momentum:") or _is_muon(k):  # the full matrix orthogonalised, as one worker does
                assert torch.equal(w0[k], v), k
            else:  # AdamW: foreach over shards against one worker's loop, the same arithmetic up to fp32 rounding
                torch.testing.assert_close(w0[k], v, atol=1e-7, rtol=0, msg=k)


def _is_muon(name: str) -> bool:
    return name.endswith("proj.weight")


def _step_apart(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> float:
    """How far apart two updates of one matrix are, as a share of the update's size."""
    return float((got - want).norm() / (want - before).norm())


def test_two_ranks_training_on_half_the_batch_each_step_like_one_worker(two_ranks):
    """The gradients agree to fp32 reduction order (the momentum to ~1e-7); bf16
    Newton-Schulz turns those last bits into differences of 0-2% of a matrix's first
    update (9% of the second, whose gradients the first moved), where orthogonalising
    each rank's half instead lands 60-80% away."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    _, (r0, _), device = two_ranks
    samples, advantages = _batch()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank
    try:
        one = _backend(device=device)
        before = _full(one)
        single = []
        for _ in range(NUM_STEPS):
            single.append((one.train_step(samples, advantages), _full(one)))
            if len(single) == 1:
                updates = {n: p.grad.cpu().lerp(single[0][1][f"momentum:{n}"], 0.95)
                           for n, p in one.model.named_parameters() if _is_muon(n)}
    finally:
        torch.set_num_threads(threads)
    for (m_one, w_one), (m0, w0) in zip(single, r0["steps"]):
        assert m0["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-4)
        for k, v in w_one.items():
            if _is_muon(k) and not k.startswith("momentum:"):
                assert _step_apart(w0[k], v, before[k]) < 0.15, k
            else:
                torch.testing.assert_close(w0[k], v, atol=ATOL, rtol=0, msg=k)
        before = w_one
    ns = (3.4445, -4.7750, 2.0315), 5, 1e-7
    for n, u in updates.items():  # what a shard's orthogonalisation would have been
        whole = _zeropower_via_newtonschulz(u, *ns).float()
        halves = torch.cat([_zeropower_via_newtonschulz(h, *ns).float() for h in u.chunk(2)])
        assert float((halves - whole).norm() / whole.norm()) > 0.5, n


def test_two_ranks_step_muon_on_fp32_sharded_params_under_bf16_compute(two_ranks):
    _, (r0, r1), _ = two_ranks
    before, metrics, after = r0["mixed"]
    assert metrics["grad_norm"] > 0 and all(torch.equal(v, r1["mixed"][2][k]) for k, v in after.items())
    for k, v in after.items():
        assert v.dtype == torch.float32 and bool(v.isfinite().all()), k
        if not k.startswith("momentum:"):
            assert not torch.equal(v, before[k]), k  # every param stepped
    assert sum(k.startswith("momentum:") for k in after) == 14


def test_a_two_rank_checkpoint_restores_the_momentum_at_two_ranks_and_at_one(two_ranks):
    out_dir, (r0, _), device = two_ranks
    saved = r0["steps"][-1][1]
    assert all(torch.equal(r0["reloaded"][k], v) for k, v in saved.items())
    continued, resumed = r0["after_resume"]
    assert all(torch.equal(continued[k], resumed[k]) for k in continued)
    one = _backend(device=device)
    one.load(out_dir / "ckpt")
    assert all(torch.equal(v, saved[k]) for k, v in _full(one).items())
    samples, advantages = _batch()
    one.train_step(samples, advantages)
    for k, v in _full(one).items():
        if _is_muon(k) and not k.startswith("momentum:"):
            assert _step_apart(v, continued[k], saved[k]) < 0.15, k
        else:
            torch.testing.assert_close(v, continued[k], atol=ATOL, rtol=0, msg=k)


def test_the_optimizer_bench_counts_one_state_tensor_per_muon_matrix_against_adamws_two(capsys):
    import json

    from bench import optimizer as bench

    bench.main(["--small", "--repeats", "1", "--warmup", "0"])
    result = json.loads(capsys.readouterr().out)
    n, m = result["params"], result["muon"]["muon_params"]
    num_tensors = len(list(bench.build_model("tiny", torch.float32, "meta").parameters()))
    assert result["adamw"]["state_bytes"] == 8 * n + 4 * num_tensors  # exp_avg, exp_avg_sq (fp32), step
    assert 4 * m + 8 * (n - m) < result["muon"]["state_bytes"] < 4 * m + 8 * (n - m) + 4 * num_tensors
    assert result["ratios"]["state_bytes"] == pytest.approx((4 * m + 8 * (n - m)) / (8 * n), rel=1e-3)
    assert result["adamw"]["step_ms"] > 0 and result["muon"]["step_ms"] > 0
