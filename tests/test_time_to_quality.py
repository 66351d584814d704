"""``bench.time_to_quality`` on the built-in tiny model (a smoke size: 2 seeds, a
few steps), its statistics with hand-computed values, and its merge of calls."""

from __future__ import annotations

import json
import math

import pytest

from bench import time_to_quality as ttq

pytestmark = pytest.mark.timeout(240)


def test_the_first_crossing_is_interpolated_between_two_evaluations():
    points = [(10.0, 0.1), (20.0, 0.3), (30.0, 0.5), (40.0, 0.2)]
    assert ttq.first_crossing(points, 0.4) == pytest.approx(25.0)  # halfway from 0.3 to 0.5
    assert ttq.first_crossing(points, 0.05) == 10.0  # already there at the first evaluation
    assert ttq.first_crossing(points, 0.6) is None  # never


def test_a_curve_is_read_between_and_held_flat_past_its_evaluations():
    points = [(0.0, 0.0), (10.0, 1.0)]
    assert ttq.interpolate(points, 2.5) == pytest.approx(0.25)
    assert ttq.interpolate(points, -1.0) == 0.0 and ttq.interpolate(points, 99.0) == 1.0


def test_the_median_time_counts_a_seed_that_never_got_there_as_last():
    assert ttq.median_or_none([3.0, None, 1.0]) == 3.0
    assert ttq.median_or_none([3.0, None]) is None  # half never reached it
    assert ttq.median_or_none([None, None, 1.0]) is None


def test_the_bootstrap_interval_holds_the_mean_and_is_reproducible():
    values = [0.1, 0.2, 0.3, 0.4, 0.5]
    low, high = ttq.bootstrap_ci(values)
    assert low < 0.3 < high and 0.1 <= low and high <= 0.5
    assert ttq.bootstrap_ci(values) == [low, high]
    assert ttq.bootstrap_ci([0.7]) == [0.7, 0.7]


def _run(policy: str, seed: int, rewards: list[float], dt: float) -> dict:
    evals = [{"step": 10 * i, "trained": 640 * i, "since_launch_s": 5.0 + dt * i, "since_first_step_s": dt * i,
              "reward": r, "response_len": 20.0} for i, r in enumerate(rewards)]
    return {"policy": policy, "seed": seed, "evals": evals, "wall_s": evals[-1]["since_launch_s"], "startup_s": 5.0,
            "train_s": evals[-1]["since_first_step_s"], "steps_per_s": 10 / dt, "trained_tokens_per_s": 100 / dt,
            "eval_s": 1.0}


def test_the_summary_times_each_policy_to_ninety_percent_of_syncs_final_reward():
    runs = {"sync": [_run("sync", 0, [0.0, 0.5, 1.0], 10.0), _run("sync", 1, [0.0, 0.4, 1.0], 10.0)],
            "fully_async": [_run("fully_async", 0, [0.0, 0.5, 1.0], 5.0),
                            _run("fully_async", 1, [0.0, 0.3, 0.5], 5.0)]}
    out = ttq.summarise(runs)
    assert out["target"] == pytest.approx(0.9)
    sync, fa = out["policies"]["sync"], out["policies"]["fully_async"]
    # sync seed 0 crosses 0.9 at 10 + 10 * 0.4 / 0.5 = 18 s of training (23 s from launch)
    assert sync["time_to_target_s"]["first_step"] == pytest.approx([18.0, 10 + 10 * 0.5 / 0.6], abs=1e-3)
    assert sync["time_to_target_s"]["launch"][0] == pytest.approx(23.0)
    assert fa["time_to_target_s"]["first_step"][1] is None  # its seed 1 never gets there
    assert fa["median_time_to_target_s"]["launch"] is None  # one of two seeds never: no median
    assert fa["median_time_to_target_over_sync"] == {"launch": None, "first_step": None}
    assert fa["steps_per_s_over_sync"] == pytest.approx(2.0)
    assert fa["goals"]["a_steps_below"] == [20]  # fully-async's 0.75 at step 20 is under sync's interval [1, 1]
    assert not fa["goals"]["a_inside_or_above_sync_interval_at_every_eval"]
    assert [c["reward_mean"] for c in fa["curve"]] == [0.0, 0.4, 0.75]
    assert out["equal_time_grid_s"][-1] == pytest.approx(15.0)  # the earliest last evaluation of any run


def test_the_benchmark_runs_two_seeds_writes_its_json_and_plot_and_merges(tmp_path):
    common = ["--steps", "4", "--eval-every", "2", "--eval-prompts", "8", "--no-warmup-run",
              "--output-dir", str(tmp_path / "runs")]
    out, png = tmp_path / "ttq.json", tmp_path / "ttq.png"
    assert ttq.main([*common, "--seeds", "2", "--out", str(out), "--png", str(png)]) == 0
    result = json.loads(out.read_text())
    assert result["policy_order"] == {"0": ["sync", "fully_async"], "1": ["fully_async", "sync"]}
    for name in ("sync", "fully_async"):
        runs = result["runs"][name]
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            assert [e["step"] for e in r["evals"]] == [0, 2, 4]
            assert [e["trained"] for e in r["evals"]] == [0, 128, 256]  # 8 prompts x 8 samples a step
            times = [e["since_launch_s"] for e in r["evals"]]
            assert times == sorted(times) and times[-1] <= r["wall_s"] + 1e-6
            assert all(e["since_first_step_s"] < e["since_launch_s"] for e in r["evals"])
            assert all(0.0 <= e["reward"] <= 1.0 for e in r["evals"])
            assert len(r["steps"]) == 4 and r["steps_per_s"] > 0 and r["startup_s"] > 0
            rows = [dict(zip(r["steps_fields"], row, strict=True)) for row in r["steps"]]
            assert all(isinstance(x["kl_behav"], float) and 0.0 <= x["clip_frac"] <= 1.0 for x in rows)  # ppo_clip's
            assert all(x["behav_capped_frac"] is None and x["dual_clip_frac"] is None for x in rows)  # neither is on
        summary = result["summary"]["policies"][name]
        assert len(summary["curve"]) == 3 and all(len(c["reward_ci95"]) == 2 for c in summary["curve"])
        assert set(summary["median_time_to_target_s"]) == {"launch", "first_step"}
        assert len(summary["reward_at_equal_time"]) == ttq.EQUAL_TIME_POINTS
    assert "goals" in result["summary"]["policies"]["fully_async"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # another call's seed of one policy pools with these; other settings are refused
    more = tmp_path / "more.json"
    assert ttq.main([*common, "--seeds", "1", "--first-seed", "2", "--policies", "sync", "--out", str(more)]) == 0
    merged_path = tmp_path / "merged.json"
    assert ttq.main(["--merge", str(out), str(more), "--out", str(merged_path)]) == 0
    merged = json.loads(merged_path.read_text())
    assert [r["seed"] for r in merged["runs"]["sync"]] == [0, 1, 2]
    assert merged["summary"]["policies"]["sync"]["seeds"] == [0, 1, 2]
    assert ttq.main(["--merge", str(out), str(more), "--policies", "fully_async", "--out", str(merged_path)]) == 0
    assert list(json.loads(merged_path.read_text())["runs"]) == ["fully_async"]  # sync's target from the first kept
    other = json.loads(more.read_text())
    other["settings"]["steps"] = 8
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="other settings"):
        ttq.main(["--merge", str(out), str(tmp_path / "other.json")])
    with pytest.raises(SystemExit, match="more than once"):
        ttq.main(["--merge", str(out), str(out)])
    assert not math.isnan(merged["summary"]["target"])

    # a later call's policy on the same seeds: each seed keeps every call's order; no part's title is kept
    again = json.loads(out.read_text())
    again["settings"]["policies"] = {"again": again["settings"]["policies"]["fully_async"]}
    again["runs"] = {"again": again["runs"]["fully_async"]}
    again["policy_order"] = {seed: ["again"] for seed in again["policy_order"]}
    (tmp_path / "again.json").write_text(json.dumps({**again, "title": "sync against fully_async"}))
    assert ttq.main(["--merge", str(out), str(tmp_path / "again.json"), "--out", str(merged_path)]) == 0
    pooled = json.loads(merged_path.read_text())
    assert pooled["policy_order"] == {"0": ["sync", "fully_async", "again"], "1": ["fully_async", "sync", "again"]}
    assert "title" not in pooled and list(pooled["runs"]) == ["sync", "fully_async", "again"]
