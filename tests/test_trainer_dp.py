"""Data-parallel trainer backend (FSDP2 over gloo, 2 ranks): each rank trains on
its own GRPO groups and the update equals one worker's on the union of them;
its local shards and shard specs assemble into the full weights and a sharded
push leaves a receiver bit-exact; its checkpoint loads at 1 rank and in HF.

Tolerances (fp32 reduction order: the ranks sum per-rank gradients, one
worker sums the same terms in another order), measured on this model:

- gradients (after clipping; the batch's norm is ~3, so clipping to 1 acts),
  each step: max |diff| <= 9e-8 for gradients up to ~9e-2; checked at atol
  2e-7 / rtol 1e-5.
- parameters after 1-3 AdamW steps at lr 1e-3: max |diff| <= 5.6e-6, at 0-15
  of the model's 397k elements above 1e-6, each one whose gradient is
  ~1e-9..1e-8, the size of Adam's eps, where the step lr * g / (|g| + eps)
  turns a 1e-10 gradient difference into a 1e-6 one; checked at atol 1e-5 /
  rtol 1e-4, as the single-worker micro-batch test does. Every step moves the
  weights by ~1e-3, far above either.
"""

from __future__ import annotations

import os
import pickle
import random

import pytest
import torch
import torch.multiprocessing as mp

from actors.backends.batching import micro_batches
from actors.backends.torch_backend import TorchBackend
from actors.models import BUILTIN_MODEL_DIR
from contracts.sample import Sample
from contracts.weights import merge_updates
from policies.losses import make_loss
from sync import WeightSender, apply_update
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(180)

GRAD_ATOL, GRAD_RTOL = 2e-7, 1e-5  # fp32 reduction order (see the module docstring)
ATOL, RTOL = 1e-5, 1e-4  # the same, through Adam's division by |g| + eps
NUM_STEPS = 3
MICRO_BATCH_TOKENS = 24  # scenario "uneven": rank 0's longer rows need more passes than rank 1's
SCENARIOS = {  # name: (loss, micro_batch_tokens)
    "even": ("ppo_clip", 0),
    "uneven": ("decoupled_ppo", MICRO_BATCH_TOKENS),  # also recomputes proximal log-probs: an extra forward a pass
}


def _batch() -> tuple[list[Sample], list[float], list[list[int]]]:
    """Four GRPO groups of two; groups 0-1 (rank 0's) have longer responses than
    groups 2-3 (rank 1's). Rollout log-probs are the initial model's, perturbed
    (a stale sampler), so ratios differ from 1. Returns samples, advantages and
    each rank's sample indices (whole groups)."""
    rng = random.Random(0)
    samples, advantages = [], []
    for g in range(4):
        prompt = [1] + [rng.randrange(3, 21) for _ in range(rng.randrange(3, 7))]
        for k in range(2):
            length = rng.randrange(6, 11) if g < 2 else rng.randrange(1, 4)
            samples.append(Sample(uid=f"g{g}s{k}", group_id=f"g{g}", prompt_ids=prompt,
                                  response_ids=[rng.randrange(3, 21) for _ in range(length)]))
            advantages.append((1.0 if k == 0 else -1.0) * (0.5 + g / 4))
    ref = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss("ppo_clip"), seed=0)
    ref.setup()
    for s, lps in zip(samples, ref.compute_logprobs(samples)):
        s.rollout_logprobs = [lp + rng.uniform(-0.1, 0.1) for lp in lps]
    return samples, advantages, [[0, 1, 2, 3], [4, 5, 6, 7]]


def _backend(scenario: str) -> TorchBackend:
    """``bf16``: a bf16 model with fp32 main params (sharded: FSDP2's mixed precision)."""
    if scenario == "bf16":
        b = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss("ppo_clip"), lr=1e-3, seed=0,
                         micro_batch_tokens=0, dtype="bfloat16", master_dtype="float32")
    else:
        loss, micro_batch_tokens = SCENARIOS[scenario]
        # padded: its passes hold the same rows at one worker and at two ranks, so only the
        # ranks' reduction order differs (packed passes split by summed length, so the rows
        # they group differ too: tests/test_packed_trainer.py checks packed against padded)
        b = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss(loss), lr=1e-3, seed=0,
                         micro_batch_tokens=micro_batch_tokens, packed=scenario != "uneven")
    b.setup()
    return b


def _full(backend: TorchBackend) -> dict[str, torch.Tensor]:
    """The full parameters, gathered on every rank (collective)."""
    return {k: v.full_tensor().clone() for k, v in backend.model.state_dict().items()}


def _grads(backend: TorchBackend) -> dict[str, torch.Tensor]:
    """The last step's full (clipped) gradients; sharded ones gathered (collective)."""
    return {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for k, p in backend.model.named_parameters()}


def _worker(rank: int, world: int, port: int, out_dir: str, batch: tuple) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        samples, advantages, split = batch
        mine = [samples[i] for i in split[rank]]
        my_adv = [advantages[i] for i in split[rank]]
        out: dict = {"passes": {}}
        for scenario in SCENARIOS:
            b = _backend(scenario)
            assert b.world_size == world and b.shard_specs() is not None
            out["passes"][scenario] = len(micro_batches(mine, b.micro_batch_tokens))
            steps = []
            senders = {dtype: WeightSender(mode="delta", dtype=dtype, bucket_bytes=4096)
                       for dtype in (torch.bfloat16, torch.float32)}
            updates = []
            for step in range(NUM_STEPS):
                metrics = b.train_step(mine, my_adv)
                steps.append((metrics, _full(b), _grads(b)))
                if scenario == "even" and step >= NUM_STEPS - 2:  # a full push, then a delta
                    w, specs = b.named_weights(), b.shard_specs()
                    updates.append({dtype: s.encode([(n, t, specs[n]) for n, t in w.items()], b.version)
                                    for dtype, s in senders.items()})
            out[scenario] = steps
            if scenario != "even":
                continue
            # log-probs with one rank's batch empty: it still joins the forward
            out["logprobs"] = b.compute_logprobs(samples if rank == 0 else [])
            w = b.named_weights()
            assert w["lm_head.weight"] is w["model.embed_tokens.weight"]  # tied: one local tensor
            out["local"] = {k: v.clone() for k, v in w.items()}
            out["local_bf16"] = {k: v.clone() for k, v in b.named_weights(dtype="bfloat16").items()}
            out["specs"] = b.shard_specs()
            out["updates"] = updates
            # checkpoint with 2 ranks; load it back into a fresh sharded backend; both take one more step
            ckpt = os.path.join(out_dir, "ckpt")
            b.save(ckpt)
            fresh = _backend(scenario)
            fresh.load(ckpt)
            assert fresh.version == b.version == NUM_STEPS
            out["reloaded_equal"] = all(torch.equal(a, c) for a, c in zip(_full(b).values(), _full(fresh).values()))
            b.train_step(mine, my_adv)
            fresh.train_step(mine, my_adv)
            out["after_resume"] = (_full(b), _full(fresh))
            # a rank whose batch is malformed: every rank raises, none hangs in a collective
            try:
                b.train_step(mine, my_adv[:-1] if rank == 1 else my_adv)
            except ValueError as e:
                out["refused"] = str(e)
        # bf16 compute on fp32 sharded params: one step, a checkpoint, a reload
        b = _backend("bf16")
        out["bf16_logprobs"] = b.compute_logprobs(samples)
        out["bf16_metrics"] = b.train_step(mine, my_adv)
        out["bf16_main"] = _full(b)
        out["bf16_dtypes"] = ({t.dtype for t in b.named_weights().values()},
                              {t.dtype for t in b.named_weights(dtype="bfloat16").values()})
        b.save(os.path.join(out_dir, "ckpt_bf16"))
        fresh = _backend("bf16")
        fresh.load(os.path.join(out_dir, "ckpt_bf16"))
        out["bf16_reloaded_equal"] = all(torch.equal(a, c) for a, c in zip(_full(b).values(), _full(fresh).values()))
        # a tensor too small to give every rank a row: rank 1's shard is empty
        tiny = torch.nn.Linear(4, 1)
        fully_shard(tiny)
        from actors.backends.torch_fsdp import shard_spec as _shard_spec

        out["tiny_spec"] = _shard_spec(tiny.weight, rank, world)
        out["tiny_local"] = tuple(tiny.weight.to_local().shape)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Both ranks' results, plus the batch and the single-worker reference."""
    out_dir = tmp_path_factory.mktemp("dp")
    batch = _batch()
    mp.spawn(_worker, args=(2, free_port(), str(out_dir), batch), nprocs=2, join=True)
    ranks = []
    for r in range(2):
        with open(out_dir / f"rank{r}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    samples, advantages, _ = batch
    single = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: fp32 sums in one thread's order (the grads agree to 2e-7)
    try:
        for scenario in SCENARIOS:
            b = _backend(scenario)
            single[scenario] = [(b.train_step(samples, advantages),
                                 {k: v.clone() for k, v in b.named_weights().items()}, _grads(b))
                                for _ in range(NUM_STEPS)]
    finally:
        torch.set_num_threads(threads)
    return {"dir": out_dir, "ranks": ranks, "batch": batch, "single": single}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = ATOL,
                  rtol: float = RTOL) -> None:
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=rtol, msg=k)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_on_half_the_groups_each_step_like_one_worker_on_all(run, scenario):
    single = run["single"][scenario]
    initial = _backend(scenario).named_weights()
    for step, ((m_single, w_single, g_single), (m0, w0, g0), (m1, w1, _)) in enumerate(
            zip(single, run["ranks"][0][scenario], run["ranks"][1][scenario])):
        assert all(torch.equal(w0[k], w1[k]) for k in w0)  # both ranks hold one model
        _assert_close(g0, g_single, GRAD_ATOL, GRAD_RTOL)
        _assert_close(w0, w_single)
        # it trained: every step moved the weights well beyond the tolerance
        assert max(float((w0[k] - initial[k]).abs().max()) for k in w0) > 1e-4 * (step + 1)
        assert m0 == m1  # the metrics describe the whole batch, the same on every rank
        assert m0["tokens"] == m_single["tokens"] == sum(len(s.response_ids) for s in run["batch"][0])
        for k in m_single:
            assert m0[k] == pytest.approx(m_single[k], rel=1e-5, abs=1e-6), k


def test_ranks_with_more_micro_batches_than_others_still_match(run):
    passes = [r["passes"]["uneven"] for r in run["ranks"]]
    assert passes[0] > passes[1] >= 1, passes  # rank 1 pads with weight-0 passes


def test_local_shards_and_specs_assemble_into_the_full_weights(run):
    r0, r1 = run["ranks"]
    full = r0["even"][-1][1]
    assert set(r0["specs"]) == set(r1["specs"]) == set(full) == set(r0["local"])
    for name, want in full.items():
        s0, s1 = r0["specs"][name], r1["specs"][name]
        assert s0.full_shape == s1.full_shape == tuple(want.shape) and s0.dim == s1.dim == 0
        assert (s0.offset, s0.offset + s0.length) == (0, s1.offset) and s1.offset + s1.length == want.shape[0]
        for spec, r in ((s0, r0), (s1, r1)):
            assert tuple(r["local"][name].shape) == spec.local_shape
            assert torch.equal(r["local_bf16"][name], r["local"][name].bfloat16())
        assert torch.equal(torch.cat([r0["local"][name], r1["local"][name]]), want), name
    assert (r0["specs"]["lm_head.weight"].length, r1["specs"]["lm_head.weight"].length) == (11, 10)  # 21 rows
    # FSDP2's uneven split down to an empty shard, as the spec says
    assert [r["tiny_spec"].length for r in run["ranks"]] == [1, 0]
    assert [r["tiny_local"] for r in run["ranks"]] == [(1, 4), (0, 4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sharded_push_leaves_a_receiver_bit_exact(run, dtype):
    from actors.models import load_causal_lm

    r0, r1 = run["ranks"]
    receiver = load_causal_lm(BUILTIN_MODEL_DIR).to(dtype).state_dict()  # lm_head tied to the embedding
    version = 0
    for u0, u1 in zip(r0["updates"], r1["updates"]):
        update = merge_updates([u0[dtype], u1[dtype]])
        version = apply_update(receiver, update, version, verify="full")
    assert [u[dtype].manifest.kind for u in r0["updates"]] == ["full", "delta"]
    full = r0["even"][-1][1]
    assert version == NUM_STEPS
    for name, want in full.items():
        assert torch.equal(receiver[name].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.to(dtype).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), name


def test_a_batch_refused_on_one_rank_raises_on_every_rank(run):
    r0, r1 = run["ranks"]
    assert r1["refused"] == "got 3 advantages for 4 samples"
    assert r0["refused"].startswith("trainer rank(s) [1] refused their part of the batch")


def test_logprobs_with_one_rank_empty_match_one_worker(run):
    r0, r1 = run["ranks"]
    assert r1["logprobs"] == []
    ref = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss("ppo_clip"), seed=0)
    ref.setup()
    ref.load(run["dir"] / "ckpt")  # the weights after the even scenario's steps
    for got, want in zip(r0["logprobs"], ref.compute_logprobs(run["batch"][0])):
        assert got == pytest.approx(want, abs=1e-5)


def test_a_two_rank_checkpoint_loads_in_one_worker_in_hf_and_resumes(run):
    import transformers

    r0 = run["ranks"][0]
    full = r0["even"][-1][1]
    ckpt = run["dir"] / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix in (".safetensors", ".pt", ".json")) == [
        "config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "trainer_state.json"]
    one = _backend("even")
    one.load(ckpt)
    assert one.version == NUM_STEPS
    assert all(torch.equal(one.named_weights()[k], v) for k, v in full.items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), local_files_only=True, dtype=torch.float32)
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in full.items())
    # a fresh 2-rank backend loaded the same checkpoint exactly and stepped the same
    assert r0["reloaded_equal"]
    continued, resumed = r0["after_resume"]
    assert all(torch.equal(continued[k], resumed[k]) for k in continued)
    # one worker resumed from it takes the same next step (the optimizer state came through)
    samples, advantages, _ = run["batch"]
    one.train_step(samples, advantages)
    single = _backend("even")
    for _ in range(NUM_STEPS + 1):
        single.train_step(samples, advantages)
    _assert_close(one.named_weights(), single.named_weights())
    _assert_close(continued, one.named_weights())


def test_bf16_compute_on_fp32_sharded_params_matches_one_mixed_precision_worker(run):
    """The sharded bf16 run keeps fp32 params and reduces fp32 gradients (FSDP2's
    mixed precision); one worker keeps fp32 main params but bf16 gradients. Same
    forward, so the same log-probs; after a step the two differ by bf16 gradient
    noise: measured, 732 of 397k fp32 params (0.2%) apart by more than lr / 2
    (Adam's first step is ~lr * sign(g): a flipped sign of a near-zero gradient)."""
    import json

    r0 = run["ranks"][0]
    samples, advantages, _ = run["batch"]
    one = _backend("bf16")
    for got, want in zip(r0["bf16_logprobs"], one.compute_logprobs(samples)):
        assert got == pytest.approx(want, abs=1e-6)
    metrics = one.train_step(samples, advantages)
    assert r0["bf16_metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-3)
    assert r0["bf16_metrics"]["tokens"] == metrics["tokens"]
    names = [n for n, _ in one.model.named_parameters()]
    main = dict(zip(names, one.optimizer.main))
    dp = r0["bf16_main"]
    assert all(dp[n].dtype == torch.float32 for n in names)
    apart = sum(int(((dp[n] - main[n]).abs() > 5e-4).sum()) for n in names)
    assert apart < 0.01 * sum(main[n].numel() for n in names), apart
    assert r0["bf16_dtypes"] == ({torch.float32}, {torch.bfloat16})  # live: the fp32 params; converted on request
    assert r0["bf16_reloaded_equal"]
    # its checkpoint: bf16 weights (the rounding the forward used), fp32 main params exact, for one worker too
    ckpt = run["dir"] / "ckpt_bf16"
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "bfloat16"
    resumed = _backend("bf16")
    resumed.load(ckpt)
    assert all(torch.equal(m, dp[n]) for n, m in zip(names, resumed.optimizer.main))
    assert all(torch.equal(resumed.named_weights()[k], v.bfloat16()) for k, v in dp.items())
