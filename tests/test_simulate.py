"""bench.simulate: the schedule model against analytic cases, and the what-ifs on kept runs
(the forecast from standalone figures: tests/test_simulate_validate.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from bench import simulate as cli
from bench.simulate_model import Inputs, Interference, LengthDist, Schedule, simulate
from bench.simulate_scaling import best_split, disaggregated

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



@pytest.mark.parametrize("overlap", [False, True])
def test_the_window_counts_finished_samples_of_unfinished_groups_and_the_batch_in_training(overlap):
    # policies.fully_async opens a window with in_flight (samples of groups not yet reported: a
    # group is reported whole) + the queue's pending + leased; counting only unfinished samples
    # let admission run past the window whenever groups were half done at a push
    inp = _inputs(train_fixed_s=0.3, group_size=8, samples_per_step=64, push_s=0.02, push_paused_s=0.005,
                  push_encode_s=0.01, lengths=LengthDist.geometric(180, 512), eval_every=5, eval_samples=64)
    for seed in range(3):
        r = simulate(inp, Schedule("fully_async", staleness_threshold=4.0, max_staleness=100, in_flight="keep",
                                   overlap_push=overlap), num_steps=12, seed=seed, warmup_steps=2)
        assert 64 <= r.max_ahead_samples <= 320

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
    # equal when nothing waits at the engine at a push (abort resubmits behind what waits there)
    assert rates["recompute"].trained_tokens_per_s >= rates["abort"].trained_tokens_per_s * (1 - 1e-12)


def test_interference_slows_each_part_only_while_the_other_is_busy():
    inp = _inputs(train_fixed_s=0.1)
    free = simulate(inp, Schedule("fully_async"), num_steps=10, warmup_steps=2)
    shared = simulate(dataclasses.replace(inp, interference=Interference(engine_shared=1.5, trainer_shared=1.5)),
                      Schedule("fully_async"), num_steps=10, warmup_steps=2)
    assert shared.trained_tokens_per_s < free.trained_tokens_per_s
    # sync generates while the trainer is idle and trains while the rollout is: no slowdown
    sync = simulate(dataclasses.replace(inp, interference=Interference(engine_shared=1.5, trainer_shared=1.5)),
                    Schedule("sync"), num_steps=10, warmup_steps=2)
    assert sync.steps_per_s == pytest.approx(1 / (0.1 + 0.1), rel=1e-6)


def test_a_decode_floor_and_the_alone_factors_slow_sync():
    # 100 decode steps of 1 ms at a floor of 2 ms: 0.2 s; the trainer alone at 1.5x its 0.2 s
    floor = simulate(_inputs(interference=Interference(decode_floor_s=2e-3)), Schedule("sync"), num_steps=6,
                     warmup_steps=1)
    assert floor.steps_per_s == pytest.approx(1 / (0.2 + 0.2), rel=1e-6)
    alone = simulate(_inputs(interference=Interference(engine_alone=2.0, trainer_alone=1.5)), Schedule("sync"),
                     num_steps=6, warmup_steps=1)
    assert alone.steps_per_s == pytest.approx(1 / (0.2 + 0.3), rel=1e-6)


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


def test_geometric_lengths_match_their_mean_and_stop_at_a_constant_rate():
    d = LengthDist.geometric(12.6, 100)
    assert d.mean() == pytest.approx(12.6, rel=1e-6)
    import random
    rng = random.Random(0)
    xs = [d.sample(rng) for _ in range(40_000)]
    assert sum(xs) / len(xs) == pytest.approx(12.6, rel=0.03)
    # P(L >= k + 1 | L >= k) is the same at every k below the cap
    at_least = [sum(x >= k for x in xs) for k in (1, 6, 11)]
    assert at_least[1] / at_least[0] == pytest.approx(at_least[2] / at_least[1], rel=0.05)
    assert LengthDist.geometric(100, 100).sample(rng) == 100


def test_an_evaluation_holds_sync_for_its_longest_response():
    # fixed 100-token responses at 1 ms a decode step: each evaluation adds 0.1 s to the step
    inp = _inputs(eval_every=1, eval_samples=8)
    r = simulate(inp, Schedule("sync"), num_steps=6, warmup_steps=2)
    assert r.steps_per_s == pytest.approx(1 / (0.1 + 0.2 + 0.1), rel=1e-6)
    assert r.eval_s_per_step == pytest.approx(0.1, rel=1e-6)
    # taken out of the wall clock (the old bench), sync is as fast as without it
    out = simulate(dataclasses.replace(inp, eval_in_wall=False), Schedule("sync"), num_steps=6, warmup_steps=2)
    assert out.steps_per_s == pytest.approx(1 / 0.3, rel=1e-6)


def test_fully_async_keeps_generating_through_an_evaluation_taken_out_of_the_wall():
    inp = _inputs(train_fixed_s=0.05, eval_every=1, eval_samples=8, lengths=LengthDist.geometric(30, 300))
    sched = Schedule("fully_async", staleness_threshold=1.0, max_staleness=4)
    counted = simulate(inp, sched, num_steps=10, warmup_steps=2)
    hidden = simulate(dataclasses.replace(inp, eval_in_wall=False), sched, num_steps=10, warmup_steps=2)
    assert hidden.trained_tokens_per_s > counted.trained_tokens_per_s


def test_sync_hides_an_evaluation_beside_training_behind_its_next_batch():
    # the evaluation (8 x 100 tokens) shares the engine with the next batch's generation, which
    # takes as long (1 ms a decode step, whatever the batch): the push after that batch's training
    # finds it done, so it costs sync nothing; waited for, it adds 0.1 s every second step
    inp = _inputs(eval_every=2, eval_samples=8)
    beside = simulate(inp, Schedule("sync", eval_overlap_steps=0), num_steps=6, warmup_steps=2)
    waited = simulate(inp, Schedule("sync"), num_steps=6, warmup_steps=2)
    assert beside.steps_per_s == pytest.approx(1 / 0.3, rel=1e-6)
    assert waited.steps_per_s == pytest.approx(2 / (0.3 + 0.3 + 0.1), rel=1e-6)


@pytest.mark.parametrize("max_staleness", [1, 3])
def test_fully_async_trains_beside_an_evaluation_within_its_staleness(max_staleness):
    # evaluations of 64 prompts (their longest response ~2.5 trainer steps: geometric lengths)
    # every 4 steps: waited for, they stop the trainer; beside training it takes
    # 1 + min(overlap, max_staleness - 1) steps meanwhile, on samples no older than max_staleness
    inp = _inputs(train_fixed_s=0.05, lengths=LengthDist.geometric(30, 1000), eval_every=4, eval_samples=64)
    sched = Schedule("fully_async", staleness_threshold=1.0, max_staleness=max_staleness)
    runs = {k: simulate(inp, dataclasses.replace(sched, eval_overlap_steps=k), num_steps=16, warmup_steps=4)
            for k in (None, 0, 2)}
    assert runs[0].steps_per_s > 1.1 * runs[None].steps_per_s
    if max_staleness > 1:
        assert runs[2].steps_per_s > 1.1 * runs[0].steps_per_s
    else:  # the cap leaves no step without its push
        assert runs[2].steps_per_s == runs[0].steps_per_s
    assert all(r.max_version_lag <= max_staleness for r in runs.values())


def test_an_evaluation_beside_training_is_timed_in_the_wall():
    with pytest.raises(ValueError, match="eval_in_wall"):
        simulate(_inputs(eval_every=1, eval_samples=8, eval_in_wall=False), Schedule("sync", eval_overlap_steps=0))


def test_per_sample_and_per_prefill_costs_stall_the_engine():
    # 32 samples a step, fixed 100 tokens at 1 ms: generation 0.1 s + 32 x (prefill + result handling)
    inp = _inputs(prefill_per_seq_s=2e-4, sample_overhead_s=3e-4)
    r = simulate(inp, Schedule("sync"), num_steps=5, warmup_steps=1)
    assert r.steps_per_s == pytest.approx(1 / (0.1 + 32 * 5e-4 + 0.2), rel=1e-6)


def test_one_step_off_pays_the_whole_push_after_the_generation():
    inp = _inputs(train_fixed_s=0.05, push_s=0.03, push_paused_s=0.01)
    r = simulate(inp, Schedule("one_step_off"), num_steps=8, warmup_steps=2)
    assert r.steps_per_s == pytest.approx(1 / (max(0.1, 0.05) + 0.03), rel=1e-6)


def test_decode_steps_per_step_count_the_straggler():
    r = simulate(_inputs(), Schedule("sync"), num_steps=4, warmup_steps=1)
    assert r.decode_steps_per_step == pytest.approx(100, rel=1e-6)


def test_a_seed_gives_the_same_run_every_time():
    inp = _inputs(train_fixed_s=0.05, lengths=LengthDist.with_mean(30, 1.2, 300), num_rollout=3)
    sched = Schedule("fully_async", staleness_threshold=1.0, max_staleness=2)
    runs = [simulate(inp, sched, num_steps=15, seed=7) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_forecast_reschedules_the_kept_runs_with_evaluations_beside_training(capsys):
    assert cli.main(["--forecast"]) == 0
    out = json.loads(capsys.readouterr().out)
    sync = out["sync"]
    assert out["unit"] == "trained tokens/s" and "not a measurement" in out["what"]
    assert abs(sync["predicted_waited"] - sync["measured"]) / sync["measured"] < 0.2
    for rows in out["fully_async"].values():
        for row in rows.values():
            assert abs(row["predicted_waited"] - row["measured"]) / row["measured"] < 0.2
            assert row["predicted_beside"] >= row["predicted_waited"]


def test_levers_take_each_limit_of_the_kept_h100_run_away(capsys):
    assert cli.main(["--levers"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["unit"] == "trained tokens/s" and "not a measurement" in out["what"]
    rows, measured = out["levers"], out["measured"]
    # the model checks out on the held-out policy of the run it was calibrated on
    assert abs(rows["as run"]["fully_async"] - measured["fully_async"]) / measured["fully_async"] < 0.2
    for row in rows.values():
        assert row["fully_async_over_sync"] == round(row["fully_async"] / row["sync"], 2)
    # a faster engine speeds both policies; only the two levers together free fully-async's overlap
    assert rows["engine at its standalone speed"]["sync"] > rows["as run"]["sync"]
    assert rows["engine + trainer"]["fully_async_over_sync"] > rows["as run"]["fully_async_over_sync"]
