"""A run either makes progress or says why not: schedules that can never train are
refused at load, a stuck run is stopped by the watchdog with what each part waits
on, and samples the queue drops as stale give their admission slots back while the
trainer still waits (a window full of them used to leave it nothing to wait for)."""

from __future__ import annotations

import pathlib
import re

import msgspec
import pytest

from actors.config import ConfigError, load_config
from actors.launch import Run, launch
from policies.base import NoProgressError

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "fully_async.yaml"
QUICK = ["run.progress=false", "rollout.max_response_tokens=8"]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_fully_async_needs_max_staleness_of_at_least_the_window_minus_one(k):
    """Step j of a sync window trains at version v + j - 1 on samples made at v."""
    load_config(CONFIG, [f"policy.trigger_parameter_sync_step={k}", f"policy.max_staleness={k - 1}"])
    if k > 1:
        with pytest.raises(ConfigError, match=rf"^policy.max_staleness: {k - 2} is below "
                                              rf"policy.trigger_parameter_sync_step - 1 = {k - 1}: "):
            load_config(CONFIG, [f"policy.trigger_parameter_sync_step={k}", f"policy.max_staleness={k - 2}"])


def test_one_step_off_needs_one_version_and_sync_needs_none():
    with pytest.raises(ConfigError, match="^policy.max_staleness: 0 with policy.type=one_step_off: .* policy.type=sync"):
        load_config(CONFIG, ["policy.type=one_step_off", "policy.max_staleness=0"])
    load_config(CONFIG, ["policy.type=one_step_off", "policy.max_staleness=1"])
    # the baselines sync after every step: trigger_parameter_sync_step does not apply to them
    load_config(CONFIG, ["policy.type=sync", "policy.max_staleness=0", "policy.trigger_parameter_sync_step=4"])


def test_every_refusal_is_one_line():
    for overrides in (["policy.type=one_step_off", "policy.max_staleness=0"],
                      ["policy.trigger_parameter_sync_step=3", "policy.max_staleness=0"]):
        with pytest.raises(ConfigError) as err:
            load_config(CONFIG, overrides)
        assert "\n" not in str(err.value)


def test_the_watchdog_stops_a_run_that_cannot_train_and_says_what_waits(tmp_path):
    """A schedule the loader refuses (max_staleness 0 with a sync every 2 steps), built
    past the check: step 2 can only find samples one version too old."""
    cfg = load_config(CONFIG, [*QUICK, f"run.output_dir={tmp_path}", "run.watchdog_s=2"])
    cfg = msgspec.structs.replace(cfg, policy=msgspec.structs.replace(
        cfg.policy, trigger_parameter_sync_step=2, max_staleness=0))
    run = Run(cfg)
    with run:
        with pytest.raises(NoProgressError) as err:
            run.train(steps=3)
        assert len(run.history) == 1  # step 1 trained; step 2 never can
    message = str(err.value)
    assert message.startswith("no trainer step finished in 2 s (run.watchdog_s): trainer: step 2 waits for 64 "
                              "samples in whole groups of 8, none older than version 1")
    # stale samples are dropped by the trainer's gets: the snapshot may catch a group put since the last one
    assert re.search(r"queue: \d+ samples waiting, 0 leased, \d+ put, dropped \{'stale': \d+\}", message), message
    assert "admission: " in message and "rollout actors: " in message
    assert (run.dir / "summary.json").is_file()  # a run that ran keeps its directory


def test_a_trainer_step_past_a_push_with_max_staleness_0_does_not_deadlock(tmp_path):
    """With the push overlapped, the step after a sync starts before the engines have the
    new weights: every sample it finds is one version old, dropped. Their admission
    slots come back while it waits, so fresh samples are admitted and it trains."""
    run = launch(CONFIG, *QUICK, f"run.output_dir={tmp_path}", "policy.overlap_push=true",
                 "policy.max_staleness=0", "run.watchdog_s=30")
    with run:
        run.train(steps=6)
        h = run.history
    assert [m["step"] for m in h] == list(range(1, 7))
    assert h[-1]["dropped"].get("stale", 0) > 0  # it did drop: the case the fix is about
    for m in h:
        assert m["staleness_max"] == 0
        assert m["produced"] == m["trained"] + sum(m["dropped"].values()) + m["pending"]
