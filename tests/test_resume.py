"""Run-level resume (issue 21): a driver killed with SIGKILL, between steps or
inside a weight push, resumes from its last checkpoint with the accounting
identity intact across both halves; SIGTERM to a run's process group stops it
with a checkpoint; a torn checkpoint is detected and the previous one used.

Each run is the default job made small (2 prompts x 4 samples, 8 tokens) driven
through the command line in a subprocess, so the test can SIGKILL the driver."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

import actors.wiring
from actors import checkpoint
from actors.config import ConfigError
from actors.launch import launch, main

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8", "run.progress=false"]
SAMPLES_PER_STEP = 2 * 4
# The mean step reward over the 10 steps after the resume may differ from the
# uninterrupted run's over the same steps by this much. Steps are 8 samples of
# rewards in [0, 1]; this job's per-step reward has a standard deviation of about
# 0.08, so a 10-step mean about 0.025 and the difference of two such means about
# 0.035: 0.1 is three of those. (The engines restart their sampling RNG and the
# generations in flight at the checkpoint are not resumed, so the curves are
# statistically, not bitwise, the same.)
REWARD_TOLERANCE = 0.1


def _cli(tmp_path: pathlib.Path, *args: str, new_session: bool = False,
         stall_push: tuple[int, pathlib.Path] | None = None) -> subprocess.Popen:
    """``python -m actors.launch *args`` in a subprocess, its output in files under ``tmp_path``
    (``new_session``: in a process group of its own, which a test may signal as a whole;
    ``stall_push``: (step, marker), the command line of :func:`main_with_a_stalled_push`)."""
    log = tmp_path / f"driver-{time.monotonic_ns()}"
    entry = ["-m", "actors.launch"]
    if stall_push is not None:
        entry = ["-c", "import sys; from tests.test_resume import main_with_a_stalled_push; "
                       "sys.exit(main_with_a_stalled_push(sys.argv[1:]))", *map(str, stall_push)]
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, *entry, *args], cwd=ROOT, stdout=out, stderr=err,
                                start_new_session=new_session)
    proc.log = log
    return proc


def main_with_a_stalled_push(argv: list[str]) -> int:
    """The command line (``argv``: ``<step> <marker path>``, then its arguments) in
    a driver whose push of trainer step ``<step>`` stalls with the engines paused
    and the update published: the first ``swap_weights`` creates the marker file
    and never returns, so a test can kill the driver there. The push is wrapped
    where the run is wired (``actors.wiring.weight_sync_fn``), in the driver's
    process, which is why this runs there (``_cli(stall_push=...)``)."""
    step_text, marker, *args = argv
    stall_step, make_weight_sync = int(step_text), actors.wiring.weight_sync_fn

    class StalledEngine:
        def __init__(self, handle: Any) -> None:
            self._handle = handle

        def __getattr__(self, name: str) -> Any:
            return getattr(self._handle, name)

        async def swap_weights(self, update: Any, *args: Any) -> Any:
            pathlib.Path(marker).touch()
            await asyncio.Event().wait()  # forever: the test kills this process here
            raise AssertionError("unreachable")

    def stalled_weight_sync_fn(*sync_args: Any, **sync_kwargs: Any) -> Any:
        weight_sync = make_weight_sync(*sync_args, **sync_kwargs)

        async def stalled(rollouts: list[Any], trainer: Any, **kwargs: Any) -> Any:
            if await trainer.get_version() == stall_step:
                rollouts = [StalledEngine(h) for h in rollouts]
            return await weight_sync(rollouts, trainer, **kwargs)

        return stalled

    actors.wiring.weight_sync_fn = stalled_weight_sync_fn
    return main(args)


def _stderr(proc: subprocess.Popen) -> str:
    return pathlib.Path(f"{proc.log}.err").read_text()


def _finish(proc: subprocess.Popen, timeout_s: float = 120) -> int:
    return proc.wait(timeout_s)


def _wait_for(what: str, cond, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the driver exited ({proc.returncode}) before {what}: {_stderr(proc)[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {timeout_s} s: {_stderr(proc)[-2000:]}")
        time.sleep(0.005)


def _run_dir(out: pathlib.Path) -> pathlib.Path | None:
    dirs = [d for d in out.iterdir() if d.is_dir()] if out.is_dir() else []
    return dirs[0] if len(dirs) == 1 else None


def _records(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process."""
    out = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            out[int(entry.name)] = (int(ppid), state)
    return out


def _descendants(pid: int) -> set[int]:
    procs, found, frontier = _processes(), set(), {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in procs.items() if ppid in frontier} - found
        found |= frontier
    return found


def _running(pids: set[int]) -> set[int]:
    procs = _processes()
    return {p for p in pids if p in procs and procs[p][1] != "Z"}


def _sigkill_driver(proc: subprocess.Popen) -> set[int]:
    """SIGKILL the driver; returns the processes it had started."""
    children = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    assert _finish(proc, 30) == -signal.SIGKILL
    return children


def _first_batch_reward(queue_file: pathlib.Path) -> float:
    """Mean reward of the first batch (whole groups, oldest first) a saved queue holds."""
    from transfer_queue import TransferQueue

    tq = TransferQueue.sync.load(str(queue_file))
    try:
        batch = tq.sync.get("check", SAMPLES_PER_STEP, sampler="grpo_group", group_size=4, timeout_s=0)
        return sum(s.reward for s in batch.samples) / len(batch.samples)
    finally:
        tq.sync.shutdown()


def _check_rollout_counts(policy_state: dict) -> None:
    """A checkpoint's totals of the rollout actors before it: each sample they
    finished queued or dropped before the queue, and what they queued is what
    the queue registered as put (samples in flight there never finished)."""
    c = policy_state["rollout_counts"]
    assert c["generated"] == c["queued"] + sum(c["dropped"].values()), c
    assert c["queued"] == policy_state["queue_put"], (c, policy_state["queue_put"])
    assert "in_flight_at_checkpoint" not in c["dropped"]  # the policy's reason, not an actor's


def _check_accounting(records: list[dict], steps: int) -> None:
    """One record per step, in order; every sample trained once, dropped with a
    reason or pending, at every step of both halves."""
    assert [m["step"] for m in records] == list(range(1, steps + 1))
    for m in records:
        assert m["produced"] == m["trained"] + sum(m["dropped"].values()) + m["pending"], m
    assert [m["trained"] for m in records] == [SAMPLES_PER_STEP * s for s in range(1, steps + 1)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """20 steps of the job, never stopped: the reference."""
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = _cli(out, "fully_async.yaml", *SMALL, "run.total_steps=20", f"run.output_dir={out}")
    assert _finish(proc) == 0, _stderr(proc)[-2000:]
    return _records(_run_dir(out))


def test_a_driver_killed_with_sigkill_resumes_from_its_last_checkpoint_with_the_accounting_intact(
        uninterrupted, tmp_path):
    out = tmp_path / "runs"
    # 40 steps asked for: the kill comes long before the end, right after the first checkpoint
    # (of steps 5, 10, 15) taken with generations in flight; the rollout may be idle at one, ahead
    proc = _cli(tmp_path, "fully_async.yaml", *SMALL, "run.total_steps=40", "run.checkpoint_every=5",
                f"run.output_dir={out}")
    for step in (5, 10, 15):
        name = f"step-{step:06d}"
        _wait_for(f"checkpoint of step {step}", lambda name=name: (d := _run_dir(out)) is not None and
                  (d / "checkpoints" / name).is_dir(), proc)
        saved_policy = checkpoint.read_state(_run_dir(out) / "checkpoints" / name)["policy"]
        lost = saved_policy["num_in_flight_dropped"]
        if lost:
            break
    run_dir = _run_dir(out)
    assert not _running(_sigkill_driver(proc))  # the local runtime: nothing outside the driver
    saved = _first_batch_reward(run_dir / "checkpoints" / name / "queue.msgpack")
    _check_rollout_counts(saved_policy)  # the resumed run checks its actors' against these at every step

    resumed = _cli(tmp_path, "--resume", str(run_dir), "run.total_steps=20")
    assert _finish(resumed) == 0, _stderr(resumed)[-2000:]
    records = _records(run_dir)
    _check_accounting(records, 20)
    first = records[step]
    assert first["resumed_from"] == f"checkpoints/{name}"
    assert first["dropped"].get("in_flight_at_checkpoint", 0) == lost > 0
    assert first["reward"] == pytest.approx(saved, abs=1e-12)  # it trained the samples the queue held
    assert records[-1]["trained"] == uninterrupted[-1]["trained"] == 20 * SAMPLES_PER_STEP
    # records the killed driver wrote after its checkpoint were set aside, not mixed in
    rolled_back = run_dir / "metrics.rolled_back.jsonl"
    if rolled_back.exists():
        assert all(json.loads(line)["step"] > step for line in rolled_back.read_text().splitlines())

    def mean_reward(rs: list[dict]) -> float:
        return sum(m["reward"] for m in rs) / len(rs)

    assert abs(mean_reward(records[10:]) - mean_reward(uninterrupted[10:])) <= REWARD_TOLERANCE
    assert abs(mean_reward(records) - mean_reward(uninterrupted)) <= REWARD_TOLERANCE
    assert [c.name for c, _ in checkpoint.list_checkpoints(run_dir)] == ["step-000015", "step-000020"]


def test_a_driver_killed_inside_a_weight_push_resumes_and_leaves_no_actor_process_behind(tmp_path):
    """Process runtime: trainer, rollout actor and queue host are children of the
    driver; killed with it while the engines are paused inside the push of step 8,
    they end too, and the run resumes from the checkpoint of step 5."""
    out, marker = tmp_path / "runs", tmp_path / "inside-push"
    proc = _cli(tmp_path, "fully_async.yaml", *SMALL, "run.total_steps=10", "run.checkpoint_every=5",
                "runtime.type=process", f"run.output_dir={out}", stall_push=(8, marker))
    _wait_for("the push of step 8", marker.exists, proc)
    run_dir = _run_dir(out)
    children = _sigkill_driver(proc)
    assert len(children) >= 3, children  # trainer, rollout actor, queue host
    deadline = time.monotonic() + 30
    while _running(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _running(children)
    for pid in left:  # ours: do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"actor processes still running 30 s after their driver was killed: {left}"
    assert [m["step"] for m in _records(run_dir)] == [1, 2, 3, 4, 5, 6]  # step 7's record waits for step 8's end

    resumed = _cli(tmp_path, "--resume", str(run_dir))
    assert _finish(resumed) == 0, _stderr(resumed)[-2000:]
    records = _records(run_dir)
    _check_accounting(records, 10)
    assert records[5]["resumed_from"] == "checkpoints/step-000005"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.rolled_back.jsonl").read_text().splitlines()] == [6]
    assert records[5]["sync/kind"] == "delta"  # the resume's own push was full; the steps' pushes go on as deltas


@pytest.fixture(scope="module", params=["local", pytest.param("process", marks=pytest.mark.slow)])
def stopped_run(request, tmp_path_factory) -> tuple[pathlib.Path, int, str, set[int]]:
    """A run stopped by SIGTERM to its whole process group (as a batch scheduler
    preempts a job; a terminal's Ctrl-C sends SIGINT the same way) after its
    whole checkpoint of step 10 (so at least two are kept, whenever the signal lands
    against a checkpoint being written): (run dir, exit code, stderr, its actor processes). Under
    the process runtime (``slow``: its start takes ~15 s here) the actors get the
    signal too and must leave it to the driver."""
    out = tmp_path_factory.mktemp("stopped")
    proc = _cli(out, "fully_async.yaml", *SMALL, "run.total_steps=100000", "run.checkpoint_every=5",
                f"runtime.type={request.param}", f"run.output_dir={out}", new_session=True)
    _wait_for("checkpoint of step 10", lambda: (d := _run_dir(out)) is not None and
              (d / "checkpoints" / "step-000010").is_dir() and checkpoint.verify(d / "checkpoints" / "step-000010")
              is None, proc)
    children = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)  # the group this test started: the driver and its actors
    rc = _finish(proc)
    return _run_dir(out), rc, _stderr(proc), children


def test_sigterm_to_the_whole_group_finishes_the_step_writes_a_checkpoint_and_exits_naming_it(stopped_run):
    run_dir, rc, err, children = stopped_run
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    line = err.strip().splitlines()[-1]
    last = _records(run_dir)[-1]["step"]
    newest = checkpoint.list_checkpoints(run_dir)[-1][0]
    assert line.startswith(f"stopped by SIGTERM after step {last}: checkpoint {newest} "), line
    assert newest.name == f"step-{last:06d}" and checkpoint.verify(newest) is None
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == last
    if run_dir.joinpath("config.yaml").read_text().count("type: process"):
        assert len(children) >= 3  # trainer, rollout actor, queue host: they outlived the signal ...
    assert not _running(children)  # ... and were closed by the driver


def test_a_torn_checkpoint_is_detected_and_the_previous_one_is_used(stopped_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_run[0], run_dir)
    (previous, prev_step), (newest, _) = checkpoint.list_checkpoints(run_dir)[-2:]
    weights = newest / "trainer" / "model.safetensors"
    with open(weights, "r+b") as f:  # torn: the end of a file never reached the disk
        f.truncate(weights.stat().st_size // 2)
    found, skipped = checkpoint.find(run_dir)
    assert found == previous and [c for c, _ in skipped] == [newest]
    assert "model.safetensors" in skipped[0][1]

    with pytest.raises(ConfigError, match=r"^trainer\.lr: cannot change when resuming"):
        launch(None, "trainer.lr=1e-3", resume=run_dir)
    run = launch(None, f"run.total_steps={prev_step + 2}", "runtime.type=local", "run.save_final=false",
                 resume=run_dir)  # no final checkpoint: it could take the torn one's name
    try:
        assert run.resumed_from == previous and len(run.history) == prev_step
        assert [m["step"] for m in run.train()] == [prev_step + 1, prev_step + 2]
    finally:
        run.close()
    assert not newest.exists()  # the torn one is gone, the timeline goes on from the previous one
    _check_accounting(_records(run_dir), prev_step + 2)


def test_find_takes_the_newest_whole_checkpoint_and_names_every_torn_one(tmp_path):
    """No model: checkpoints of fake files, sealed by ``commit``, then broken the
    ways a crash or a disk breaks them."""
    def write(step: int) -> pathlib.Path:
        tmp = checkpoint.new_tmp_dir(tmp_path, step)
        for name in ("state.json", "config.yaml", "queue.msgpack", "trainer/model.safetensors"):
            (tmp / name).parent.mkdir(exist_ok=True)
            (tmp / name).write_text(f"{name} of step {step}")
        return checkpoint.commit(tmp, tmp_path, step, keep=3)

    first, second, third = write(5), write(10), write(15)
    assert [c for c, _ in checkpoint.list_checkpoints(tmp_path)] == [first, second, third]
    assert write(20) and not first.exists()  # keep=3: the oldest went once the fourth was whole
    newest = checkpoint.checkpoints_dir(tmp_path) / "step-000020"
    (newest / "MANIFEST.json").unlink()  # never sealed
    data = (third / "queue.msgpack").read_bytes()
    (third / "queue.msgpack").write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, other bytes
    checkpoint.new_tmp_dir(tmp_path, 25)  # a writer that died half way
    found, skipped = checkpoint.find(tmp_path)
    assert found == second
    assert [(c.name, why.split(" ")[0]) for c, why in skipped] == [("step-000020", "no"), ("step-000015", "queue.msgpack")]
    assert checkpoint.find(second) == (second, [])
    with pytest.raises(ValueError, match="is torn: queue.msgpack does not match its sha256"):
        checkpoint.find(third)


# -- the policy's own state ---------------------------------------------------------------------------

# Times go on from the checkpoint's, not equal to it; in-flight samples were counted dropped once, when it was taken.
_NOT_ROUND_TRIPPED = {"elapsed_s", "trainer_busy_s", "rollout_busy_s", "num_in_flight_dropped"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["fully_async", "one_step_off", "sync"])
def test_a_resumed_policy_takes_back_the_whole_state_of_its_checkpoint(policy, tmp_path):
    """Counters, prompt RNG, admission, the fully-async schedule's mark of released
    queue drops, the one-step-off batch ahead, and the fault counters the records
    report: the resumed policy's ``state_dict`` is the checkpoint's."""
    import loop

    run = launch(ROOT / "fully_async.yaml", *SMALL, f"policy.type={policy}", "runtime.type=local",
                 f"run.output_dir={tmp_path}")
    with run:
        run.train(3)
        p = run.policy
        # fault counters of a run that lost an actor and a push (cumulative: the records go on counting)
        p.num_failed_pushes, p.num_lost_rollouts, p.num_respawns = 2, 1, 1
        ckpt = run.save_checkpoint()
    saved = checkpoint.read_state(ckpt)["policy"]
    assert saved.get("batch_ahead", False) == (policy == "one_step_off")
    _check_rollout_counts(saved)

    resumed = launch(None, resume=run.dir)
    with resumed:
        p = resumed.policy
        state = p.state_dict(loop.run(resumed.queue.statistics_async()))
        assert {k: v for k, v in state.items() if k not in _NOT_ROUND_TRIPPED} == \
            {k: v for k, v in saved.items() if k not in _NOT_ROUND_TRIPPED}
        assert p.next_group(0).group_id == f"g{saved['num_groups']}"  # ids go on, none reused
        queued = {g for g, _, _ in loop.run(resumed.queue.pending_groups())}
        (m,) = resumed.train(1)
        if policy == "fully_async":  # admission order: the step trains the checkpoint's oldest queued groups
            k = run.cfg.trainer.batch_prompts
            oldest = [g for g, _ in saved["group_order"]][:k]
            assert len(oldest) == k and set(oldest) <= queued
            assert not set(oldest) & {g for g, _, _ in loop.run(resumed.queue.pending_groups())}
            assert not {r for r in m["dropped"] if r.startswith("stale")}  # none went stale waiting
        assert (m["failed_pushes"], m["lost_rollout_actors"], m["respawned_rollout_actors"]) == (2, 1, 1)
        # the new actors count from zero, beside the totals of those before: exact again with rollout stopped
        resumed.check()
        new = [loop.run(h.statistics()) for h in p.rollouts]
        assert all(st["num_generated"] == st["num_queued"] + sum(st["dropped"].values()) > 0 for st in new)
        totals = p.rollout_totals()
        assert totals.generated == totals.queued + sum(totals.dropped.values())
        assert totals.queued == saved["queue_put"] + sum(st["num_queued"] for st in new) == \
            loop.run(resumed.queue.statistics_async()).put


@pytest.mark.timeout(120)
def test_one_step_off_resumes_with_its_next_batch_queued_and_every_batch_one_version_old(tmp_path):
    """Between steps the one-step-off schedule has its next batch queued: resumed,
    it trains that one rather than generating another in front of it (which left
    two batches queued and every later batch two versions old)."""
    run = launch(ROOT / "fully_async.yaml", *SMALL, "policy.type=one_step_off", "runtime.type=local",
                 f"run.output_dir={tmp_path}")
    with run:
        before = run.train(4)
        run.save_checkpoint()
    resumed = launch(None, resume=run.dir)
    with resumed:
        after = resumed.train(4)
    assert [m["staleness_max"] for m in before] == [0, 1, 1, 1]
    assert [m["staleness_max"] for m in after] == [1, 1, 1, 1]
    assert [m["pending"] for m in before + after] == [SAMPLES_PER_STEP] * 8  # one batch ahead, never two
    assert [m["trained"] for m in after] == [SAMPLES_PER_STEP * s for s in range(5, 9)]
    assert all(not m["dropped"] for m in after)
