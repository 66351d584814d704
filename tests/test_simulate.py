"""bench.simulate: the schedule model against analytic cases, and the CLI's one JSON object."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from bench import simulate as cli
from bench.simulate_model import Inputs, LengthDist, Schedule, best_split, disaggregated, simulate

pytestmark = pytest.mark.timeout(120)


def _inputs(**kw) -> Inputs:
    base = dict(decode_base_s=1e-3, decode_per_seq_s=0.0, prefill_per_token_s=0.0, train_fixed_s=0.2,
                train_per_token_s=0.0, push_s=0.0, push_paused_s=0.0, push_encode_s=0.0,
                lengths=LengthDist.fixed(100), prompt_len=10, samples_per_step=32, group_size=4)
    base.update(kw)
    return Inputs(**base)


@pytest.mark.parametrize("train_s", [0.05, 0.1, 0.3])
def test_sync_is_the_sum_and_one_step_off_the_max_with_free_pushes(train_s):
    inp = _inputs(train_fixed_s=train_s)
    gen_s = 100 * 1e-3  # fixed 100-token responses, 1 ms a decode step
    sync = simulate(inp, Schedule("sync"), num_steps=10, warmup_steps=2)
    off = simulate(inp, Schedule("one_step_off"), num_steps=10, warmup_steps=2)
    assert sync.steps_per_s == pytest.approx(1 / (gen_s + train_s), rel=1e-6)
    assert off.steps_per_s == pytest.approx(1 / max(gen_s, train_s), rel=1e-6)
    assert sync.trained_tokens_per_s == pytest.approx(sync.steps_per_s * 32 * 100)


def test_sync_pays_the_push_every_step():
    inp = _inputs(push_s=0.05, push_paused_s=0.03)
    r = simulate(inp, Schedule("sync"), num_steps=5, warmup_steps=1)
    assert r.steps_per_s == pytest.approx(1 / (0.1 + 0.2 + 0.05), rel=1e-6)


@pytest.mark.parametrize("s", [0.0, 0.5, 1.0, 2.0])
def test_staleness_threshold_bounds_how_far_ahead_rollout_runs(s):
    # a slow trainer: the rollout would run arbitrarily far ahead without the window
    inp = _inputs(train_fixed_s=1.0)
    r = simulate(inp, Schedule("fully_async", staleness_threshold=s, max_staleness=100), num_steps=8)
    assert r.max_ahead_samples <= math.ceil((1 + s) * 32)
    assert r.max_ahead_samples >= 32


def test_staleness_zero_makes_fully_async_wait_like_sync():
    inp = _inputs()
    fa = simulate(inp, Schedule("fully_async", staleness_threshold=0.0), num_steps=10, warmup_steps=2)
    sync = simulate(inp, Schedule("sync"), num_steps=10, warmup_steps=2)
    assert fa.steps_per_s == pytest.approx(sync.steps_per_s, rel=1e-6)
    assert fa.max_version_lag == 0


def test_trained_samples_are_never_older_than_max_staleness():
    inp = _inputs(train_fixed_s=0.01, lengths=LengthDist.with_mean(20, 1.0, 400))
    r = simulate(inp, Schedule("fully_async", staleness_threshold=2.0, max_staleness=1, in_flight="keep"), num_steps=30)
    assert r.max_version_lag <= 1
    assert r.dropped > 0  # long samples spanning pushes were dropped, not trained


def test_abort_costs_more_than_recompute_and_recompute_more_than_keep():
    inp = _inputs(train_fixed_s=0.05, prefill_per_token_s=2e-4, push_s=0.01, push_paused_s=0.01,
                  lengths=LengthDist.with_mean(40, 1.2, 400), prompt_len=50)
    rates = {m: simulate(inp, Schedule("fully_async", staleness_threshold=1.0, max_staleness=10, in_flight=m),
                         num_steps=20, warmup_steps=2)
             for m in ("keep", "recompute", "abort")}
    assert rates["keep"].reprefill_tokens == 0
    assert rates["abort"].reprefill_tokens > 0 and rates["recompute"].reprefill_tokens > 0
    assert rates["keep"].trained_tokens_per_s > rates["recompute"].trained_tokens_per_s
    assert rates["recompute"].trained_tokens_per_s >= rates["abort"].trained_tokens_per_s


def test_contention_slows_a_colocated_run():
    inp = _inputs(train_fixed_s=0.1)
    free = simulate(inp, Schedule("fully_async"), num_steps=10, warmup_steps=2)
    shared = simulate(dataclasses.replace(inp, colocated=True, contention=1.5), Schedule("fully_async"),
                      num_steps=10, warmup_steps=2)
    assert shared.trained_tokens_per_s < free.trained_tokens_per_s


def test_split_search_finds_the_analytic_optimum():
    # Generation takes 0.1 s at any R (the 32 samples decode side by side, the step does not
    # grow with the batch); training 0.8 s / T. One-step-off runs max(gen, train): best with
    # every GPU but one training.
    inp = _inputs(train_fixed_s=0.0, train_per_token_s=0.8 / (32 * 110), samples_per_step=32, group_size=1)
    r, tokens_per_s, _ = best_split(8, disaggregated(inp, Schedule("one_step_off"), 8, num_steps=6),
                                    candidates=list(range(1, 8)))
    assert r == 1
    assert tokens_per_s == pytest.approx(32 * 100 / max(0.1, 0.8 / 7), rel=1e-3)
    # With a decode step that grows per running sequence, gen(R) = ceil(32 / R) * 0.1 s: the optimum
    # is where max(gen(R), train(8 - R)) is least.
    inp2 = dataclasses.replace(inp, decode_base_s=0.0, decode_per_seq_s=1e-3)
    r2, _, _ = best_split(8, disaggregated(inp2, Schedule("one_step_off"), 8, num_steps=6))
    analytic = max(range(1, 8), key=lambda k: 1 / max(math.ceil(32 / k) * 0.1, 0.8 / (8 - k)))
    assert r2 == analytic


def test_length_distribution_matches_its_mean():
    d = LengthDist.with_mean(12.0, 0.8, 100)
    assert d.mean() == pytest.approx(12.0, rel=1e-3)
    import random
    rng = random.Random(0)
    xs = [d.sample(rng) for _ in range(40_000)]
    assert sum(xs) / len(xs) == pytest.approx(12.0, rel=0.05)
    assert max(xs) == 100


def test_validate_prints_one_json_object(capsys):
    assert cli.main(["--validate"]) == 0
    out = capsys.readouterr().out
    d = json.loads(out)  # one object, nothing else on stdout
    assert d["runs"] and d["left_out"]
    calibration_runs = {s["calibrated_on"] for s in d["setups"].values()}
    for row in d["runs"]:
        assert row["run"] not in calibration_runs
        for p in row["policies"].values():
            assert set(p) == {"predicted_tokens_per_s", "measured_tokens_per_s", "relative_error"}


def test_a_seed_gives_the_same_run_every_time():
    inp = _inputs(train_fixed_s=0.05, lengths=LengthDist.with_mean(30, 1.2, 300), num_rollout=3)
    sched = Schedule("fully_async", staleness_threshold=1.0, max_staleness=2)
    runs = [simulate(inp, sched, num_steps=15, seed=7) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
