"""Soak: the default job for many steps under the Ray runtime, a random rollout
actor killed (SIGKILL) about every ``--kill-every`` steps; prints ONE JSON object.

    python -m bench.soak [--steps 2000] [--kill-every 100] [--out bench/results/soak/soak_cpu.json]

What it checks, as figures (tests/test_soak.py asserts on them):

- the driver's open file descriptors, threads and RSS, and those of the actors
  that live through the whole run (the trainer, the queue host), at the end of
  the warm-up (step ``--warmup``, before the first kill) and at the end, with a
  sample every ``--kill-every`` steps in between (a leak grows with the kills);
- the run's processes (the driver's descendants: Ray's own, the actors' workers)
  at both ends: a killed actor's worker is gone, its replacement's there;
- the accounting identity ``produced == trained + dropped + pending`` of every
  step's record, the policy's own check at the end, and the queue's identity;
- each rollout actor's own count, ``generated == queued + dropped before the
  queue`` (checked by the policy at every step: a step it fails stops the soak),
  the killed ones' as last seen; at the end, with rollout stopped (``run.check``),
  the live actors' counters are their last reports' and the queue's put is
  exactly what the actors queued (the killed ones' as reported) plus what the
  killed ones took unreported (``lost``).

A kill comes right after a step picked at random in each window of
``--kill-every`` steps (the first window after the warm-up), from a thread
that watches the run's history, so it lands while the rollout actors
generate; the victim is drawn from the live rollout actors. The run replaces
each dead actor (``rollout.max_respawns``): its replacement joins at the next
weight push.

``ASYNCRL_SOAK_STEPS`` sets the default of ``--steps`` (tests run it short).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_STEPS = 2000


def resources(pid: int | str = "self") -> dict[str, float] | None:
    """Open fds, threads and RSS (MiB) of process ``pid`` (None when it is gone)."""
    proc = pathlib.Path(f"/proc/{pid}")
    try:
        fds = len(os.listdir(proc / "fd"))
        threads = len(os.listdir(proc / "task"))
        status = (proc / "status").read_text()
    except OSError:
        return None
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"fds": fds, "threads": threads, "rss_mb": round(rss_kb / 1024, 1)}


def _descendants(pid: int) -> list[int]:
    """Live (non-zombie) processes below ``pid``."""
    parent: dict[int, int] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state != "Z":
            parent[int(entry.name)] = int(ppid)
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return sorted(found)


def _actor_pid(title: str) -> int | None:
    """The pid of the Ray worker whose process title starts with ``title`` (``ray::QueueHost``)."""
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").startswith(title):
                    return int(entry.name)
            except OSError:
                continue
    return None


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def _deep_size_mb(obj: Any) -> float:
    """Bytes held by ``obj`` (dicts, lists and what they hold), in MiB."""
    seen: set[int] = set()

    def size(o: Any) -> int:
        if id(o) in seen:
            return 0
        seen.add(id(o))
        n = sys.getsizeof(o)
        if isinstance(o, dict):
            n += sum(size(k) + size(v) for k, v in o.items())
        elif isinstance(o, (list, tuple)):
            n += sum(size(x) for x in o)
        return n

    return round(size(obj) / 2**20, 1)


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return out.stdout.strip() + (" (working tree has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class _Killer(threading.Thread):
    """SIGKILLs ``pid`` as soon as the run's history reaches ``after_step`` steps."""

    def __init__(self, run: Any, after_step: int, pid: int) -> None:
        super().__init__(name="soak-killer", daemon=True)
        self.watched, self.after_step, self.pid = run, after_step, pid
        self.done = threading.Event()
        self.at_step: int | None = None

    def run(self) -> None:  # noqa: D102 - threading's entry point
        try:
            while len(self.watched.history) < self.after_step:
                time.sleep(0.002)
            self.at_step = len(self.watched.history)
            os.kill(self.pid, signal.SIGKILL)
        finally:
            self.done.set()


def soak(steps: int, kill_every: int = 100, warmup: int | None = None, seed: int = 0,
         num_actors: int = 2, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the soak; returns the result (see the module docstring)."""
    import loop
    from actors.launch import launch

    warmup = min(kill_every, max(1, steps // 20)) if warmup is None else warmup
    rng = random.Random(seed)
    out_dir = tempfile.mkdtemp(prefix="asyncrl-soak-")
    cfg = [f"run.output_dir={out_dir}", "run.progress=false", f"run.total_steps={steps}", "runtime.type=ray",
           f"rollout.num_actors={num_actors}", f"rollout.max_respawns={steps}", *overrides]
    t0 = time.perf_counter()
    run = launch(ROOT / "fully_async.yaml", *cfg)
    setup_s = time.perf_counter() - t0
    kills: list[dict[str, Any]] = []
    series: list[dict[str, Any]] = []
    try:
        policy = run.policy
        trainer_pid = loop.run(policy.trainer.ping())
        queue_pid = _actor_pid("ray::QueueHost")
        survivors = {"trainer": trainer_pid, **({"queue_host": queue_pid} if queue_pid else {})}

        def snapshot() -> dict[str, Any]:
            gc.collect()
            return {"step": policy.step, "driver": resources(),
                    **{name: resources(pid) for name, pid in survivors.items()},
                    "processes": len(_descendants(os.getpid())), "rollout_actors": len(policy.rollouts)}

        run.train(warmup)
        start = snapshot()
        t_start = time.perf_counter()
        series.append(start)
        step = warmup
        while step < steps:
            window = min(kill_every, steps - step)
            if window >= max(2, kill_every // 2):  # a kill in every window but a short last one ...
                # ... in its first half in the last window, so its replacement has time to join before the end
                after = rng.randint(1, window - 1 if step + window < steps else max(1, window // 2))
                victim = rng.choice(policy.rollouts)
                pid = loop.run(victim.ping())
                killer = _Killer(run, step + after, pid)
                killer.start()
                run.train(window)
                killer.join(timeout=60)
                kills.append({"after_step": killer.at_step, "actor": victim.name, "pid": pid})
            else:
                run.train(window)
            step += window
            series.append(snapshot())
        wall_s = time.perf_counter() - t_start
        end = series[-1]
        run.check(timeout_s=120)  # raises AccountingError if an identity does not hold (rollout stopped: exactly)
        stats = loop.run(run.queue.statistics_async())
        actors = {name: {"generated": c.generated, "queued": c.queued, "dropped": sum(c.dropped.values())}
                  for name, c in policy.rollout_counts.items()}
        totals = policy.rollout_totals()
        last = run.history[-1]
        identity_every_step = all(m["produced"] == m["trained"] + sum(m["dropped"].values()) + m["pending"]
                                  for m in run.history)
        result = {
            "bench": "soak",
            "machine": f"{os.cpu_count()}-core {platform.machine()} VM ({_cpu_model()}), no GPU, "
                       f"python {platform.python_version()}; shared with other sessions' jobs",
            "commit": _git_commit(),
            "config": ["fully_async.yaml", *cfg[1:]],
            "steps": len(run.history), "warmup_steps": warmup, "kill_every": kill_every, "seed": seed,
            "setup_s": round(setup_s, 1), "wall_s": round(wall_s, 1),
            "kills": kills, "num_kills": len(kills),
            "lost_rollout_actors": policy.num_lost_rollouts, "respawned_rollout_actors": policy.num_respawns,
            "failed_pushes": policy.num_failed_pushes,
            "rollout_actors_at_end": [h.name for h in policy.rollouts],
            "start": start, "end": end, "series": series,
            # the driver's RSS grows by the step records it keeps (run.history): this much of it
            "history_mb": _deep_size_mb(run.history),
            "growth": {who: {k: round(end[who][k] - start[who][k], 1) for k in start[who]}
                       for who in ("driver", *survivors) if start.get(who) and end.get(who)},
            "accounting": {"produced": last["produced"], "trained": last["trained"],
                           "dropped": last["dropped"], "pending": last["pending"],
                           "holds": last["produced"] == last["trained"] + sum(last["dropped"].values()) + last["pending"],
                           "holds_every_step": identity_every_step,
                           "queue": {"put": stats.put, "delivered": stats.delivered, "dropped": stats.dropped,
                                     "pending": stats.pending, "in_flight": stats.in_flight,
                                     "holds": stats.put == stats.delivered + stats.dropped + stats.pending
                                     + stats.in_flight},
                           # by actor name, the killed ones' as last seen; "lost": samples of groups a killed
                           # actor took unreported that the queue had (put by it, counted by none)
                           "rollout_actors": {"actors": actors, "queued": totals.queued,
                                              "lost": policy.lost_queued, "queue_put": stats.put,
                                              "holds": all(a["generated"] == a["queued"] + a["dropped"]
                                                           for a in actors.values())}},
            "reward_first100": round(sum(m["reward"] for m in run.history[:100]) / min(100, len(run.history)), 4),
            "reward_last100": round(sum(m["reward"] for m in run.history[-100:]) / min(100, len(run.history)), 4),
            "load_average_end": list(os.getloadavg()),
        }
    finally:
        run.close()
        shutil.rmtree(out_dir, ignore_errors=True)  # the run directory: metrics only, the figures are returned
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("ASYNCRL_SOAK_STEPS", DEFAULT_STEPS)))
    p.add_argument("--kill-every", type=int, default=100)
    p.add_argument("--warmup", type=int, default=None, help="steps before the start snapshot (default: "
                   "min(kill-every, steps/20))")
    p.add_argument("--num-actors", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = p.parse_args(argv)
    # Ray's raylet reports each killed worker on the driver's stdout: it goes to stderr, the JSON alone to stdout
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        result = soak(args.steps, args.kill_every, args.warmup, args.seed, args.num_actors, tuple(args.overrides))
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
    text = json.dumps(result, indent=1)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
