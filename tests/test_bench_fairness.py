"""Fair benchmarks (issue 28): ``bench.async_vs_sync`` rotates the order of the
policies from seed to seed, warms every run alike, counts in-loop evaluations
inside the timed window and takes its speedups from means over seeds;
``bench.weight_sync`` reports the median whole push, measured in one span, with
the per-component minima beside it as a lower bound. The built-in 397k model,
a few steps of a tiny batch: seconds each."""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest

from bench import async_vs_sync, pipeline_report, weight_sync

pytestmark = pytest.mark.timeout(180)

#: The smallest real benchmark: the built-in model, 4-digit reversals, one process.
SMALL = ["--task", "reverse_digits", "--task-max-len", "4", "--batch-prompts", "2", "--n", "2",
         "--max-response-tokens", "8", "--steps", "2", "--warmup-steps", "1", "--runtime", "local"]


def _main(module, argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(argv)
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory) -> dict:
    """Two policies over two seeds, an evaluation after every step, the throw-away run first."""
    out = tmp_path_factory.mktemp("avs")
    return _main(async_vs_sync, [*SMALL, "--policies", "sync,fully_async", "--seeds", "2", "--eval-prompts", "2",
                                 "--eval-every", "1", "--output-dir", str(out)])


def test_the_policy_order_alternates_across_seeds_and_is_in_the_json(bench_result):
    assert bench_result["policy_order"] == {"0": ["sync", "fully_async"], "1": ["fully_async", "sync"]}
    for name in ("sync", "fully_async"):
        runs = bench_result["policies"][name]["seeds"]
        assert [r["seed"] for r in runs] == [0, 1]
        assert [r["position"] for r in runs] == [bench_result["policy_order"][str(r["seed"])].index(name)
                                                 for r in runs]


def test_more_policies_rotate_so_each_runs_first_once_in_as_many_seeds():
    names = ["sync", "one_step_off", "fully_async"]
    orders = [async_vs_sync.rotated(names, seed) for seed in range(4)]
    assert orders[:3] == [names, ["one_step_off", "fully_async", "sync"], ["fully_async", "sync", "one_step_off"]]
    assert orders[3] == orders[0] and sorted(o[0] for o in orders[:3]) == sorted(names)


def test_runs_go_in_the_recorded_order_after_one_throw_away_run(monkeypatch, tmp_path):
    calls = []

    def fake_one(policy, seed, runtime, args, workers=1):
        calls.append((policy, seed))
        return {"seed": seed, "wall_s": 1.0, "steps_per_s": 2.0, "tokens_per_s": 10.0, "sync_ms_mean": 1.0}

    monkeypatch.setattr(async_vs_sync, "_one", fake_one)
    result = _main(async_vs_sync, ["--policies", "sync,one_step_off,fully_async", "--seeds", "3",
                                   "--no-standalone", "--output-dir", str(tmp_path)])
    assert result["warmup_run"] is True and calls[0] == ("sync", 3)  # a seed no timed run uses
    assert result["warmup_runs"] == [{"policy": "sync", "runtime": "process", "seed": 3,
                                      "seconds": result["warmup_runs"][0]["seconds"]}]
    assert calls[1:] == [(p, seed) for seed in range(3) for p in result["policy_order"][str(seed)]]
    assert [result["policy_order"][str(s)][0] for s in range(3)] == ["sync", "one_step_off", "fully_async"]
    calls.clear()
    result = _main(async_vs_sync, ["--policies", "sync,fully_async", "--seeds", "1", "--no-warmup-run",
                                   "--no-standalone", "--output-dir", str(tmp_path)])
    assert result["warmup_run"] is False and "warmup_runs" not in result and calls == [("sync", 0), ("fully_async", 0)]


def test_evaluations_count_inside_the_timed_window_by_default(bench_result):
    assert bench_result["eval_in_window"] is True and "eval_in_window_means" in bench_result
    for name in ("sync", "fully_async"):
        for run in bench_result["policies"][name]["seeds"]:
            # an evaluation after each of the 2 timed steps, timed with them
            assert [s for s, _, _ in run["eval_curve"]][-2:] == [2, 3] and run["eval_s"] > 0
            assert run["wall_s"] == run["wall_with_eval_s"] >= run["eval_s"]
            assert run["steps_per_s"] == pytest.approx(2 / run["wall_s"])


def test_every_run_warms_alike_with_a_weight_sync_and_an_evaluation(bench_result):
    runs = [r for name in ("sync", "fully_async") for r in bench_result["policies"][name]["seeds"]]
    assert bench_result["warmup_steps"] == 1 and {r["warmup_steps"] for r in runs} == {1}
    assert all(r["warmup_weight_version"] >= 1 and r["warmup_evals"] >= 1 for r in runs)


def test_speedups_come_from_mean_tokens_and_steps_per_second_over_seeds_and_per_seed(bench_result):
    pol = bench_result["policies"]
    for rate in ("tokens_per_s", "steps_per_s"):
        sync = [r[rate] for r in pol["sync"]["seeds"]]
        fa = [r[rate] for r in pol["fully_async"]["seeds"]]
        assert bench_result[f"speedup_{rate}_fully_async_over_sync"] == \
            pytest.approx(statistics.fmean(fa) / statistics.fmean(sync))
        assert bench_result[f"speedup_{rate}_fully_async_over_sync_per_seed"] == \
            [round(b / a, 3) for a, b in zip(sync, fa)]
        assert pol["sync"][rate]["min"] == min(sync) and pol["sync"][rate]["max"] == max(sync)
    assert bench_result["speedup_fully_async_over_sync"] == bench_result["speedup_tokens_per_s_fully_async_over_sync"]


def test_each_run_sets_its_engine_and_trainer_against_them_alone(bench_result):
    stand = bench_result["standalone"]
    assert stand["engine_concurrency"] == {"sync": 4, "fully_async": 12}  # one batch; the admission window
    assert {str(c) for c in stand["engine_concurrency"].values()} == set(stand["engine"])
    assert stand["trainer"]["step_ms"] > 0 and stand["response_tokens"] >= 1
    repeats = stand["trainer"]["step_ms_repeats"]  # the bound is the mean of 8 (steps can be bimodal)
    assert len(repeats) == 8 and stand["trainer"]["step_ms"] == pytest.approx(statistics.fmean(repeats), abs=0.01)
    assert stand["trainer"]["step_ms_median"] == pytest.approx(statistics.median(repeats), abs=0.01)
    assert stand["trainer"]["captures_retimed"] == 0  # no graphs on a CPU
    assert set(bench_result["pipeline_fields"]) >= {"engine_in_loop_over_standalone", "pipeline_efficiency"}
    for name in ("sync", "fully_async"):
        for run in bench_result["policies"][name]["seeds"]:
            assert run["engine_tokens_per_s"] > 0 and 0 < run["engine_busy_ratio"] <= 1
            # what the window generated for training bounds what it sustains; sync trains what it generated
            assert run["sustained_tokens_per_s"] <= run["tokens_per_s"] * (1 + 1e-9)
            assert run["backlog_share"] == pytest.approx(1 - run["sustained_tokens_per_s"] / run["tokens_per_s"])
            if name == "sync":
                assert run["backlog_share"] == pytest.approx(0.0, abs=1e-9)
            assert run["engine_in_loop_over_standalone"] == pytest.approx(
                run["engine_tokens_per_s"] / run["engine_standalone_tokens_per_s"])
            assert run["trainer_step_ms_median"] > 0 and run["trainer_standalone_step_ms"] > 0
            assert "trainer_mfu" in run  # null on a CPU: its peak is not known
            # a weight sync after each of the 2 timed steps; fully-async's steps beside an evaluation
            # (one after every step here) leave their push to the step after it (policy.eval_overlap_steps)
            assert run["num_syncs"] == 2 if name == "sync" else 1 <= run["num_syncs"] <= 2
            assert run["sync_total_ms_max"] >= run["sync_total_ms_median"] > 0
            assert run["sync_paused_ms_max"] >= run["sync_paused_ms_median"] >= 0
            parts = run["sync_parts_ms_mean"]  # the trainer's encode inside its whole call, inside the trip
            assert 0 < parts["sender_encode"] <= parts["source"] <= parts["encode"]
            assert run["wait_ms_mean"] >= 0
            assert 0 < run["pipeline_efficiency"] <= 1.5 and run["pipeline_bound_by"] in ("engine", "trainer")
            assert run["step_s"] == pytest.approx(1 / run["steps_per_s"])
            # CPU clocks over the window (local runtime: the loop and the process are the driver's)
            assert 0 < run["engine_thread_cpu_share"] <= 1.05 and 0 < run["rollout_loop_cpu_share"] <= 1.05
            assert run["rollout_process_cpu_share"] >= run["engine_thread_cpu_share"]
            for off in (run["engine_offcpu_share"], run["engine_standalone_offcpu_share"]):
                assert 0 <= off < 1  # the engine's thread ran on a CPU for some of its turns
            for split in (run["engine_turn_us"], run["engine_standalone_turn_us"]):  # the turn by part, both
                assert set(split) == {"host", "forward", "sample", "device_wait", "num_turns"}
                assert split["num_turns"] > 0 and split["forward"] > 0
            if run.get("num_probes"):  # the window's samples by where they are (a probe every 50 ms)
                assert (run["samples_admitted_mean"] is None) == (name == "sync")
                assert min(run[k] for k in ("samples_in_engine_mean", "samples_finished_in_rollout_mean",
                                            "samples_queued_mean", "samples_in_trainer_mean")) >= 0
            phases = {k: v for k, v in run["startup"].items() if k != "total_s"}
            assert {"actors_s", "first_step_s"} <= set(phases)
            assert sum(phases.values()) <= run["startup_s"] + 0.006  # each rounded to the millisecond
        assert bench_result["policies"][name]["pipeline_efficiency"]["mean"] > 0


def test_the_speedup_is_the_ratio_of_means_not_the_mean_of_ratios():
    def run(tokens_per_s: float) -> dict:
        return {"wall_s": 1.0, "steps_per_s": 1.0, "tokens_per_s": tokens_per_s}

    out = async_vs_sync.compare({"sync": [run(100.0), run(300.0)], "fully_async": [run(300.0), run(300.0)]})
    assert out["speedup_fully_async_over_sync"] == pytest.approx(1.5)  # the mean of the ratios would be 2.0
    assert out["speedup_fully_async_over_sync_per_seed"] == [3.0, 1.0]
    assert out["policies"]["sync"]["tokens_per_s"] == {"mean": 200.0, "spread": 200.0, "min": 100.0, "max": 300.0}


def test_a_window_that_trains_a_backlog_generated_before_it_sustains_only_what_it_generated():
    counters = dict.fromkeys(pipeline_report.engine_counters([]), 0.0)
    after = {**counters, "num_generated_tokens": 900.0, "num_decode_steps": 10.0, "turn_s": 1.0}
    hist = [{"num_tokens": 500, "train_s": 0.1, "eval/response_len_mean": 50.0, "eval/num_prompts": 2},
            {"num_tokens": 700, "train_s": 0.1}]
    out = pipeline_report.in_loop(hist, 12, counters, after, wall_s=2.0, num_engines=1)
    # 900 generated, 100 of them the evaluation's: 800 for training against 1,200 trained
    assert out["rollout_tokens_in_window"] == 800.0
    assert out["sustained_tokens_per_s"] == 400.0 and out["backlog_share"] == pytest.approx(400 / 1200)
    out = pipeline_report.in_loop(hist, 12, counters, {**after, "num_generated_tokens": 1500.0}, 2.0, 1)
    assert out["sustained_tokens_per_s"] == 600.0 and out["backlog_share"] == 0.0  # the rest: after the window

    def run(trained: float, sustained: float) -> dict:
        return {"wall_s": 1.0, "steps_per_s": 1.0, "tokens_per_s": trained, "sustained_tokens_per_s": sustained}

    out = async_vs_sync.compare({"sync": [run(100.0, 100.0)], "fully_async": [run(300.0, 200.0)]})
    assert out["speedup_fully_async_over_sync"] == 3.0
    assert out["speedup_sustained_tokens_per_s_fully_async_over_sync"] == 2.0
    runs = {"sync": [{**run(100.0, 100.0), "backlog_share": 0.0}],
            "fully_async": [{**run(300.0, 200.0), "backlog_share": 1 / 3}]}
    (note,) = async_vs_sync.backlog_notes(async_vs_sync.compare(runs)["policies"])
    assert note.startswith("fully_async trained 33%-33% of its windows' tokens")


def test_eval_outside_the_window_subtracts_it_and_says_what_that_means(tmp_path):
    result = _main(async_vs_sync, [*SMALL, "--policies", "fully_async", "--seeds", "1", "--eval-prompts", "2",
                                   "--eval-every", "1", "--eval-outside-window", "--no-warmup-run",
                                   "--output-dir", str(tmp_path)])
    assert result["eval_in_window"] is False and "not paused" in result["eval_in_window_means"]
    (run,) = result["policies"]["fully_async"]["seeds"]
    assert run["eval_s"] > 0 and run["wall_s"] == pytest.approx(run["wall_with_eval_s"] - run["eval_s"])


def test_a_warm_up_too_short_for_a_weight_sync_is_refused(capsys):
    for argv, message in ((["--policies", "sync,fully_async", "--warmup-steps", "0"], "--warmup-steps: at least 1"),
                          (["--policies", "sync,fully_async_k2", "--warmup-steps", "1"],
                           "fully_async_k2 syncs every 2"),
                          (["--warmup-steps", "2", "policy.trigger_parameter_sync_step=3"], "at least 3")):
        with pytest.raises(SystemExit):
            async_vs_sync.parse_args(argv)
        assert message in capsys.readouterr().err
    assert async_vs_sync.parse_args(["--policies", "fully_async_k2", "--warmup-steps", "2"]).warmup_steps == 2


# ---------------------------------------------------------------- bench.weight_sync


def test_push_figures_headline_a_measured_median_with_the_component_minima_beside_it():
    # (encode, stage, transfer, apply, whole): each component's minimum comes from another repeat
    repeats = [(1.0, 0.0, 9.0, 9.0, 19.5), (9.0, 0.0, 1.0, 9.0, 19.25), (9.0, 0.0, 9.0, 1.0, 19.0),
               (5.0, 0.0, 5.0, 5.0, 15.5)]
    got = weight_sync.push_figures(repeats)
    assert got["push_ms_median"] == 19.0 and got["push_ms_median"] in got["push_ms_repeats"]  # median_low
    assert (got["push_ms_min"], got["push_ms_max"]) == (15.5, 19.5)
    assert got["component_min_ms"] == {"encode": 1.0, "stage": 0.0, "transfer": 1.0, "apply": 1.0}
    assert got["sum_of_component_minima_ms"] == 3.0 < got["push_ms_min"]  # no push was that fast
    assert got["paused_ms_min_max"] == [1.0, 9.0] and got["paused_ms_median"] == 5.0  # the apply: the swap


def test_weight_sync_reports_the_median_whole_push_at_least_the_sum_of_component_minima():
    result = _main(weight_sync, ["--small", "--transports", "inproc", "--repeat", "3", "--settle-s", "0"])
    assert "push_ms_median" in result["timing"]
    for row in result["runs"]:
        assert row["delta_bytes"] < row["full_bytes"] and 0 < row["changed_fraction"] < 1
        out = row["transports"]["inproc"]
        for kind in ("full", "delta"):
            push = out[kind]
            assert len(push["push_ms_repeats"]) == 3 and push["push_ms_median"] in push["push_ms_repeats"]
            assert push["push_ms_min"] <= push["push_ms_median"] <= push["push_ms_max"]
            assert push["push_ms_min"] >= push["sum_of_component_minima_ms"] == \
                pytest.approx(sum(push["component_min_ms"].values()), abs=0.02)
            assert set(push["component_min_ms"]) == {"encode", "stage", "transfer", "apply"}
            assert push["component_min_ms"]["encode"] >= row["encode_ms_min"][kind]
            assert push["paused_ms_min_max"][0] <= push["paused_ms_median"] <= push["paused_ms_min_max"][1]
            assert "total_ms" not in push  # the composite sum is named as what it is
        assert out["delta_over_full"] == round(out["delta"]["push_ms_median"] / out["full"]["push_ms_median"], 3)
        # what the default sync.mode pushes in one process on the CPU, and its figures
        default = out["default"]
        assert (default["mode"], default["as_transport"]) == ("delta", "inproc")
        assert default["push_ms_median"] == out["delta"]["push_ms_median"]
        assert default["paused_ms_median"] == out["delta"]["paused_ms_median"]
        assert default["is_faster"] == (out["faster"] == "delta")


def test_the_window_probe_counts_samples_by_where_they_are():
    import asyncio

    from bench import pipeline_report

    class FakeRollout:  # a fake rollout handle: its engine holds 5 running, 1 waiting
        async def statistics(self):
            return {"num_running": 5, "num_waiting": 1}

    class FakeQueue:  # a fake queue client: 4 samples queued, 8 in the trainer's hands
        async def statistics_async(self):
            return type("S", (), {"pending": 4, "in_flight": 8})()

    class FakePolicy:  # fully-async's counters: 20 admitted, 10 in the rollout actors
        rollouts = [FakeRollout()]
        queue = FakeQueue()
        in_flight = 10
        admission = type("A", (), {"carried": 12, "admitted_in_window": 8})()

    async def body():
        probes: list = []
        task = asyncio.ensure_future(pipeline_report.probe_samples(FakePolicy(), probes))
        await asyncio.sleep(pipeline_report.BUDGET_PROBE_S * 3.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return probes

    probes = asyncio.run(body())
    assert len(probes) >= 2
    assert pipeline_report.where_samples_are(probes) == {
        "samples_admitted_mean": 20, "samples_in_engine_mean": 6, "samples_finished_in_rollout_mean": 4,
        "samples_queued_mean": 4, "samples_in_trainer_mean": 8, "num_probes": len(probes)}
    assert pipeline_report.where_samples_are([]) == {}


def test_the_bench_runs_while_the_loop_runs_in_its_background_thread(tmp_path):
    """As a notebook, or an earlier caller of ``loop.submit``, leaves it: the window's probe
    starts and stops on the loop's own thread all the same."""
    import asyncio

    import loop

    was_in_background = loop._thread is not None
    loop.submit(asyncio.sleep(0)).result()
    try:
        result = _main(async_vs_sync, [*SMALL, "--policies", "fully_async", "--seeds", "1", "--no-warmup-run",
                                       "--no-standalone", "--output-dir", str(tmp_path)])
    finally:
        if not was_in_background:
            loop.shutdown()  # the next test gets a loop of its own, as before
    run = result["policies"]["fully_async"]["seeds"][0]
    assert run["tokens_per_s"] > 0 and "samples_admitted_mean" in run


def test_a_standalone_step_that_captured_graphs_is_timed_again():
    """A fake graphed backend (named so): its first step on a batch captures (0.2 s), later
    ones replay (0.01 s). The standalone bound keeps the replay, and counts the capture."""
    import time
    from types import SimpleNamespace

    from bench.pipeline_report import timed_step

    class FakeGraphedBackend:
        def __init__(self) -> None:
            self._graphs, self.seen = SimpleNamespace(capture_s=0.0), set()

        def train_step(self, batch, adv):
            if batch[0] not in self.seen:
                self.seen.add(batch[0])
                self._graphs.capture_s += 0.2
                time.sleep(0.2)
            time.sleep(0.01)

    backend = FakeGraphedBackend()
    seconds, captured = timed_step(backend, ["a"], [1.0], "cpu")
    assert captured and seconds < 0.1
    seconds, captured = timed_step(backend, ["a"], [1.0], "cpu")
    assert not captured and seconds < 0.1
    seconds, captured = timed_step(SimpleNamespace(train_step=lambda b, a: time.sleep(0.01)), ["b"], [1.0], "cpu")
    assert not captured and 0.01 <= seconds < 0.1
