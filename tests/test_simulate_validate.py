"""bench.simulate --validate: kept runs forecast from standalone figures and the kept
interference model (its JSON's fields, every kept run accounted for, no validated run's
in-loop clock among the inputs, predictions that move the right way, the kept files current)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from bench import simulate as cli
from bench import simulate_validate as sv

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def validation() -> dict:
    return sv.validate("test")


def test_validate_prints_one_json_object(capsys):
    assert cli.main(["--validate"]) == 0
    d = json.loads(capsys.readouterr().out)  # one object, nothing else on stdout
    assert d["bench"] == "simulate --validate" and d["runs"]


def test_validate_json_has_every_field(validation):
    d = validation
    assert {"method", "goal", "goal_met", "summary", "interference_model", "naive", "runs", "calibration_runs",
            "excluded"} <= set(d)
    assert all(reason for reason in d["excluded"].values())
    calibration = {r["run"] for r in d["calibration_runs"]["runs"]}
    assert calibration == set(d["interference_model"]["fit_on"])
    errors, naive = [], []
    for row in d["runs"]:
        assert row["run"] not in calibration
        assert {"gpu", "runtime", "era", "standalone", "recorded_where"} <= set(row)
        for p in row["policies"].values():
            assert set(p) == {"measured_tokens_per_s", "predicted_tokens_per_s", "naive_tokens_per_s", "error",
                              "naive_error"}
            m = p["measured_tokens_per_s"]
            assert p["error"] == pytest.approx((p["predicted_tokens_per_s"] - m) / m, abs=2e-3)
            assert p["naive_error"] == pytest.approx((p["naive_tokens_per_s"] - m) / m, abs=2e-3)
            errors.append(abs(p["error"]))
            naive.append(abs(p["naive_error"]))
    s = d["summary"]
    assert s["predictions"] == len(errors) and s["runs"] == len(d["runs"])
    assert s["simulator"]["max_abs_error"] == pytest.approx(max(errors))
    assert s["simulator"]["mean_abs_error"] == pytest.approx(sum(errors) / len(errors), abs=1e-3)
    assert s["naive"]["mean_abs_error"] == pytest.approx(sum(naive) / len(naive), abs=1e-3)
    assert s["within_25pct"] == (max(errors) <= sv.GOAL)
    assert len(s["misses"]) == sum(e > sv.GOAL for e in errors)
    assert d["goal_met"] == (s["within_25pct"] and s["lower_mean_error_than_naive"])


def test_the_forecast_beats_the_naive_predictor(validation):
    s = validation["summary"]
    assert s["simulator"]["mean_abs_error"] < s["naive"]["mean_abs_error"]


def test_every_kept_async_vs_sync_run_is_validated_calibrated_or_excluded(validation):
    d = validation
    covered = {r["run"].split("#")[0] for r in d["runs"] + d["calibration_runs"]["runs"]} | set(d["excluded"])
    folders = (sv.RESULTS / "async_vs_sync", sv.RESULTS / "archive" / "async_vs_sync")  # current, superseded
    kept = {str(p.relative_to(folder)) for folder in folders for p in folder.rglob("async_vs_sync_*")}
    assert "clean_clone_e91d83a/async_vs_sync_cpu.json" in kept and len(kept) > 40
    assert kept <= covered


def test_every_kept_gpu_run_with_a_standalone_section_is_forecast():
    forecast = {s.file.split("#")[0] for s in sv.VALIDATE + sv.CALIBRATION}
    for path in [*sv.RESULTS.glob("*/async_vs_sync_h[12]00_*.json"),
                 *sv.RESULTS.glob("archive/*/async_vs_sync_h[12]00_*.json")]:
        d = json.loads(path.read_text())
        if "standalone" in d.get("result", d):
            assert path.name in forecast


def test_a_kept_run_is_found_by_its_name_current_or_archived():
    assert sv.kept("async_vs_sync_h100_smollm2_staleness6_warm10_41990f0.json").parent == sv.RESULTS / "async_vs_sync"
    assert sv.kept("async_vs_sync_h100_smollm2_graphs.json").parent == sv.RESULTS / "archive" / "async_vs_sync"
    assert sv.kept("clean_clone_e91d83a/async_vs_sync_cpu.json").parent.name == "clean_clone_e91d83a"
    with pytest.raises(FileNotFoundError, match="none"):
        sv.kept("async_vs_sync_nowhere.json")


def test_the_kept_interference_model_is_what_calibrate_fits():
    kept = json.loads(sv.INTERFERENCE_FILE.read_text())
    fresh = sv.calibrate()
    assert kept["model"] == json.loads(json.dumps(fresh["model"]))
    assert kept["fit_on"] == fresh["fit_on"]


def test_the_kept_validation_is_what_validate_prints(validation):
    kept = json.loads(sv.kept("simulate_validate.json").read_text())
    for key in ("summary", "runs", "goal_met", "excluded"):
        assert kept[key] == json.loads(json.dumps(validation[key])), key


def _scale_numbers(x, factor: float):
    """Every number in a JSON tree times ``factor`` (booleans kept)."""
    if isinstance(x, dict):
        return {k: _scale_numbers(v, factor) for k, v in x.items()}
    if isinstance(x, list):
        return [_scale_numbers(v, factor) for v in x]
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x * factor
    return x


@pytest.mark.parametrize("name", ["async_vs_sync_h100_smollm2_staleness6_warm10_41990f0.json",
                                  "async_vs_sync_h100_smollm2_2dd85bc.json"])
def test_a_validated_runs_in_loop_clocks_are_no_input_of_its_forecast(name, tmp_path, monkeypatch):
    # a copy of the kept results where every in-loop figure of the run (its policies: clocks,
    # throughput, idle ratios, response lengths, wall times) is scaled; only `measured` moves
    shutil.copytree(sv.RESULTS, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.png", "*.log"))
    run = json.loads(sv.kept(name).read_text())
    run["policies"] = _scale_numbers(run["policies"], 1.7)
    (tmp_path / sv.kept(name).relative_to(sv.RESULTS)).write_text(json.dumps(run))
    spec = next(s for s in sv.VALIDATE if s.file == name)
    loop = sv.load_loop()
    before = sv._row(spec, loop)
    monkeypatch.setattr(sv, "RESULTS", tmp_path)
    after = sv._row(spec, loop)
    for policy, p in before["policies"].items():
        q = after["policies"][policy]
        assert q["predicted_tokens_per_s"] == p["predicted_tokens_per_s"]
        assert q["naive_tokens_per_s"] == p["naive_tokens_per_s"]
        assert q["measured_tokens_per_s"] == pytest.approx(p["measured_tokens_per_s"] * 1.7, rel=1e-3)


@pytest.mark.parametrize("policy", ["sync", "fully_async"])
def test_a_slower_standalone_engine_trainer_or_push_forecasts_fewer_tokens(policy):
    spec = next(s for s in sv.VALIDATE if s.file == "async_vs_sync_h100_smollm2_staleness6_warm10_41990f0.json")
    run, loop = sv._load(spec.file), sv.load_loop()
    sa = sv.standalone_figures(spec, run)
    base = sv.predict(spec, run, sa, loop, policy)
    slower = {
        # a bigger model: the standalone line well above the loop's floor
        "engine": dataclasses.replace(sa, decode_base_s=sa.decode_base_s * 3, decode_per_row_s=sa.decode_per_row_s * 3),
        "trainer": dataclasses.replace(sa, train_s_per_token=sa.train_s_per_token * 3),
        "push": dataclasses.replace(sa, push_s=sa.push_s * 10, push_paused_s=sa.push_paused_s * 10),
    }
    for what, s in slower.items():
        assert sv.predict(spec, run, s, loop, policy) < base, what


def test_a_standalone_length_that_is_no_measurement_is_refused():
    spec = sv.RunSpec("async_vs_sync_h200_smollm2_mps.json")  # its bench took half the cap
    with pytest.raises(ValueError, match="lengths_from"):
        sv.standalone_figures(spec, sv._load(spec.file))


def test_sync_is_forecast_at_the_floor_and_fully_async_beside_the_trainer():
    loop = sv.load_loop()
    spec = sv.RunSpec("async_vs_sync_h100_smollm2_ca68ec2.json")
    sync, fa = loop.interference(spec, "sync"), loop.interference(spec, "fully_async")
    assert sync.engine_alone == sync.engine_shared == 1.0
    assert fa.engine_alone == fa.engine_shared == loop.era["bb7c3cf"].engine_beside > 1.0
    assert sync.decode_floor_s == fa.decode_floor_s == loop.decode_floor_s
    assert sv.schedule_of(sv._load(spec.file), "fully_async", spec).in_flight == "keep"


def test_the_naive_predictor_adds_for_sync_and_takes_the_larger_for_fully_async():
    spec = sv.RunSpec("async_vs_sync_h100_smollm2_ca68ec2.json")
    run, loop = sv._load(spec.file), sv.load_loop()
    sa = sv.standalone_figures(spec, run)
    b, length = int(run["batch_size"]), sa.response_len_mean
    train_s = sa.train_s_per_token * b * (sa.prompt_len + length)
    f = loop.interference(spec, "sync")
    engine_s = b * length / sa.engine_tokens_per_s["sync"]  # 64 rows: above the floor
    assert 64 / sa.engine_tokens_per_s["sync"] > f.decode_floor_s
    push_s = sa.push_s * loop.runtime["process"].push["sync"]
    assert sv.naive(spec, run, sa, loop, "sync") == pytest.approx(
        b * length / (engine_s + train_s * f.trainer_alone + push_s))
    f = loop.interference(spec, "fully_async")
    rows = sv.concurrency(run, "fully_async")
    engine_s = b * length / rows * max(f.decode_floor_s, rows / sa.engine_tokens_per_s["fully_async"])
    assert sv.naive(spec, run, sa, loop, "fully_async") == pytest.approx(
        b * length / max(engine_s * f.engine_shared, train_s * f.trainer_shared))


def test_calibrate_writes_the_kept_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "simulate_interference.json"
    monkeypatch.setattr(sv, "INTERFERENCE_FILE", out)
    assert cli.main(["--calibrate"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    assert set(printed["fit_on"]) == {s.file for s in sv.CALIBRATION}
    assert sv.kept("simulate_interference.json") == sv.RESULTS / "simulate" / "simulate_interference.json"
