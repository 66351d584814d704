"""The soak run (issue 21, acceptance 3): ``bench.soak`` in a subprocess, the
default job under the Ray runtime for ``ASYNCRL_SOAK_STEPS`` steps (2000 unless
set; at least 100), a random rollout actor SIGKILLed about every 100 steps
and replaced.

Flat, from the end of the warm-up (before the first kill) to the end, for the
driver and the actors that live through the run (trainer, queue host):

- open file descriptors and threads: up to ``FD_SLACK`` / ``THREAD_SLACK`` more.
  A leak per kill (a pipe, a gloo group, a reader thread kept for each dead actor)
  grows by one or more per kill: 19 kills in 2000 steps are past the slack;
- RSS: up to ``RSS_SLACK_MB`` more. The driver keeps every step's metrics record
  (``run.history``, a few kB each: ~10 MB over 2000 steps) and allocators keep
  what they have touched; a leak per step or per kill of anything sample- or
  weight-sized (the model is ~2 MB of float32 per copy) is far past it;
- the run's processes: as many at the end (a killed actor's worker is gone, its
  replacement's is there), give or take one (Ray may start a spare worker).

And nothing lost: every step's record and the end state keep
``produced == trained + dropped + pending``, and so does the queue's own count;
each rollout actor's own count keeps ``generated == queued + dropped before the
queue`` (the killed ones' as last seen), and the actors' queued is the queue's
put, give or take what killed actors took unreported (``run.check`` at the end
asserts it exactly).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FD_SLACK = 8
THREAD_SLACK = 8
RSS_SLACK_MB = 64.0

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.mark.timeout(3600)
def test_a_long_run_whose_rollout_actors_keep_being_killed_stays_flat_and_loses_no_sample(tmp_path):
    steps = int(os.environ.get("ASYNCRL_SOAK_STEPS", "2000"))
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "bench.soak", "--steps", str(steps), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=3500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)  # one JSON object, alone on stdout
    assert r == json.loads(out.read_text())

    assert r["steps"] == steps
    assert r["num_kills"] >= max(1, (steps - r["warmup_steps"]) // r["kill_every"])  # one a window (steps >= 100)
    assert all(k["after_step"] is not None for k in r["kills"])
    # every kill was noticed and replaced; the replacements joined (the last one had half a window)
    assert r["lost_rollout_actors"] == r["respawned_rollout_actors"] == r["num_kills"]
    assert r["end"]["rollout_actors"] == r["start"]["rollout_actors"]

    for who, growth in r["growth"].items():
        assert growth["fds"] <= FD_SLACK, (who, growth, r["series"])
        assert growth["threads"] <= THREAD_SLACK, (who, growth, r["series"])
        assert growth["rss_mb"] <= RSS_SLACK_MB, (who, growth, r["series"])
    assert set(r["growth"]) >= {"driver", "trainer"}
    assert abs(r["end"]["processes"] - r["start"]["processes"]) <= 1, r["series"]

    acc = r["accounting"]
    assert acc["holds"] and acc["holds_every_step"] and acc["queue"]["holds"], acc
    assert acc["produced"] == acc["trained"] + sum(acc["dropped"].values()) + acc["pending"]
    assert acc["trained"] == steps * 64  # 8 prompts x 8 samples a step, every step
    actors = acc["rollout_actors"]
    assert actors["holds"] and len(actors["actors"]) >= r["start"]["rollout_actors"], actors
    assert all(a["generated"] == a["queued"] + a["dropped"] for a in actors["actors"].values()), actors
    assert actors["queued"] <= actors["queue_put"] <= actors["queued"] + actors["lost"], actors
