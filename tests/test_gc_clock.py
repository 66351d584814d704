"""actors/gc_clock.py: the collector's pauses summed by generation; freeze after setup."""

from __future__ import annotations

import gc

from actors import gc_clock


def test_the_clock_counts_every_collection_and_the_full_ones_apart():
    gc_clock.install()
    gc_clock.install()  # idempotent: one hook
    assert gc.callbacks.count(gc_clock._hook) == 1
    before = gc_clock.snapshot()
    gc.collect(0)
    gc.collect()  # a full collection
    after = gc_clock.snapshot()
    assert after["gc_collections"] - before["gc_collections"] >= 2
    assert after["gc_full_collections"] - before["gc_full_collections"] >= 1
    assert after["gc_pause_s"] - before["gc_pause_s"] >= after["gc_full_pause_s"] - before["gc_full_pause_s"] > 0
    assert after["gc_pause_max_s"] >= after["gc_full_pause_s"] - before["gc_full_pause_s"]


def test_freeze_moves_what_is_alive_out_of_the_collections_unless_turned_off(monkeypatch):
    assert gc.get_freeze_count() == 0
    try:
        monkeypatch.setenv("ASYNCRL_GC_FREEZE", "0")
        gc_clock.freeze()
        assert gc.get_freeze_count() == 0
        monkeypatch.delenv("ASYNCRL_GC_FREEZE")
        gc_clock.freeze()
        assert gc.get_freeze_count() > 1000  # the test process's modules, at least
    finally:
        gc.unfreeze()  # this process is pytest's


def test_the_freeze_bench_alternates_the_first_side_and_sets_the_switch_for_each_run(monkeypatch, capsys):
    import json
    import os

    from bench import async_vs_sync, gc_freeze

    seen = []

    def fake_one(policy, seed, runtime, args, workers=1):  # a fake run: records the switch it ran under
        seen.append((policy, seed, os.environ["ASYNCRL_GC_FREEZE"]))
        on = os.environ["ASYNCRL_GC_FREEZE"] == "1"
        return {"tokens_per_s": 120.0 if on else 100.0, "engine_tokens_per_s": 1.0, "wall_s": 1.0,
                "rollout_gc_share": 0.001 if on else 0.05, "engine": {"gc_full_collections": 0 if on else 1}}

    monkeypatch.setattr(async_vs_sync, "_one", fake_one)
    monkeypatch.delenv("ASYNCRL_GC_FREEZE", raising=False)
    assert gc_freeze.main(["--pairs", "2", "--steps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert seen == [("fully_async", 0, "1"), ("fully_async", 0, "0"), ("fully_async", 1, "0"), ("fully_async", 1, "1")]
    assert "ASYNCRL_GC_FREEZE" not in os.environ  # left as it was
    assert out["tokens_per_s_ratio_per_pair"] == [1.2, 1.2] and out["speedup_freeze"] == 1.2
    assert out["gc_share_median"] == {"freeze": 0.001, "no_freeze": 0.05}
