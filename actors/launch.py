"""Start a run: ``python -m actors.launch fully_async.yaml [key.path=value ...]``;
continue one: ``python -m actors.launch --resume runs/<dir> [run.total_steps=...]``.

From a notebook::

    from actors.launch import launch
    run = launch("fully_async.yaml", "trainer.lr=2e-6")
    run.train(steps=10)      # step by step; call again to continue
    await run.train_async(10)       # the same from code on an event loop
    run                      # Run(fully_async, step 20/500, reward 0.41, staleness 0.80, 95.3 samples/s, runs/...)
    run.metrics(); run.plot()       # the records as a table (pandas); reward, staleness, throughput
    run.close()
    run = launch(resume=run.dir)   # later: from its newest checkpoint

The stop button (KeyboardInterrupt), or cancelling ``train_async``, stops
training at the next step boundary: the step in progress finishes with its
weight push, and the same run trains again at once (``notebooks/quickstart.ipynb``).

Inside an existing Ray cluster: ``runtime.type=ray runtime.address=auto``
(the cluster is joined, never shut down by the run).

Checkpoints (``actors/checkpoint.py`` has the format): every ``run.checkpoint_every``
steps and, from the command line, on SIGTERM / SIGINT (the step in progress
finishes, a checkpoint is written, the process exits with 128 + the signal's
number and one line naming it; a second signal, or no step boundary within
``run.stop_grace_s``, stops at once, without one: :class:`_StopOnSignals`). A
checkpoint is taken between steps: weight push finished, no batch leased.
Samples still being generated then are not saved: a run resumed from it counts
them dropped, ``in_flight_at_checkpoint`` (``PolicyBase.state_dict``). Resuming
rebuilds the run from the checkpoint's config, loads the trainer, pushes its
weights in full to the engines, restores counters, RNG states and the queue's
samples, and goes on numbering steps and appending to ``metrics.jsonl`` (records
of steps after the checkpoint, lost with the process, move to
``metrics.rolled_back.jsonl``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import logging
import os
import pathlib
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

import loop
from actors import checkpoint, notebook
from actors.config import Config, ConfigError, checkpoint_every, load_config, load_resume_config, to_yaml
from actors.loggers import open_metrics_log

__all__ = ["Run", "RunStopped", "launch", "main"]


class RunStopped(RuntimeError):
    """The run stopped on a signal (SIGTERM, SIGINT) after writing a checkpoint."""

    def __init__(self, signum: int, step: int, path: pathlib.Path, run_dir: pathlib.Path) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint {path} "
                         f"(continue with: python -m actors.launch --resume {run_dir})")
        self.signum, self.step, self.checkpoint = signum, step, path


class Run:
    """A live run: actors placed, queue open, policy ready. Methods are
    synchronous (they drive the process's one loop) so notebooks can call them."""

    def __init__(self, cfg: Config, *, resume: pathlib.Path | None = None,
                 task_data: dict[str, Any] | None = None) -> None:
        """``resume``: a whole checkpoint (``checkpoint.find``) whose config ``cfg``
        is (``load_resume_config``); ``launch(resume=...)`` finds both. ``task_data``:
        task options no config file can hold (``launch(data=...)``)."""
        self._task_data = dict(task_data or {})
        from actors.models import resolve_model_path

        self.cfg = cfg
        # a wrong model path fails before anything is created on disk
        self.model_path = str(resolve_model_path(cfg.model.path, cfg.base_dir))
        self.resumed_from = resume
        self._resume_step = 0  # the step of the checkpoint resumed from
        if resume is None:
            made = self._make_dir()  # what this run created on disk: removed again if setup fails
            (self.dir / "config.yaml").write_text(to_yaml(cfg))
        else:
            self.dir, made = resume.parents[1], []  # an existing run: nothing is removed if setup fails
        self.history: list[dict[str, Any]] = []
        self._metrics_file: Any = None
        self.last_checkpoint: pathlib.Path | None = None
        self._stop_signal: int | None = None  # set by request_stop: checkpoint after this step, then stop
        self._train_call: _TrainCall | None = None  # the train call in progress (interrupt stops it)
        self._closed = False
        self._discarded = False  # setup failed: no summary, the run directory removed
        self.stop_reason: str | None = None  # the line a run stopped early with, kept in summary.json
        self.runtime: Any = None
        self.policy: Any = None
        self.queue: Any = None
        self.weight_transport = ""  # chosen by placement at setup (sync.link.choose_transport)
        self.initial_eval: dict[str, Any] | None = None  # held-out eval before the first step (policy.eval_every)
        try:
            loop.run(self._setup())
            if resume is not None:
                loop.run(self._restore(resume))
            # metrics.jsonl and the run.loggers mirroring it (actors/loggers.py)
            self._metrics_file = open_metrics_log(self.dir, cfg.run,
                                                  resume_step=None if resume is None else self._resume_step)
        except BaseException:
            self._discard(made)
            raise

    def _make_dir(self) -> list[pathlib.Path]:
        """Create ``self.dir`` (a new one: a second run in the same second gets a suffix);
        returns the directories created, deepest first."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"{self.cfg.run.name}-{stamp}-{os.getpid()}"
        out = pathlib.Path(self.cfg.run.output_dir)
        for i in itertools.count():
            self.dir = out / (name if i == 0 else f"{name}-{i}")
            made = [d for d in (self.dir, *self.dir.parents) if not d.exists()]
            try:
                self.dir.mkdir(parents=True)
                return made
            except FileExistsError:
                continue
        raise AssertionError("unreachable")

    def _discard(self, made: list[pathlib.Path]) -> None:
        """Setup failed: stop what was started and remove what this run created on
        disk (its directory, and parents it made that are left empty). Nothing ran."""
        self._discarded = True
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the setup error is the one to report; this one would hide it
            pass
        if not made:  # resuming: the run directory is not ours to remove
            return
        shutil.rmtree(self.dir, ignore_errors=True)
        for d in made[1:]:
            try:
                d.rmdir()  # only while empty
            except OSError:
                break

    async def _setup(self) -> None:
        """Compose the run: runtime, queue, actors (each holding a queue client),
        the weight link chosen by placement, the policy (control only)."""
        import msgspec

        from actors.rollout import RolloutActor
        from actors.runtime import make_runtime
        from actors.trainer import TrainerActor, TrainerGroup
        from contracts.rollout import SamplingParams
        from policies import make_policy
        from policies.advantages import grpo_advantages
        from policies.losses import make_loss_from_config
        from policies.partial import absorb, next_request
        from policies.tasks import make_task
        from sync.link import TrainerLink, weight_sync_fn

        cfg = self.cfg
        make_task_fn = functools.partial(make_task, cfg.task.type, model_path=self.model_path,
                                         reward_timeout_s=cfg.policy.reward_timeout_s, **self._task_kwargs())
        task = make_task_fn()
        if cfg.policy.eval_every:  # a task without held-out prompts fails here, not at the first evaluation
            task.eval_prompts(cfg.policy.eval_prompts)
        # A cluster we start gets at least one logical CPU per actor, so a
        # laptop with fewer cores than actors still places them all (oversubscribed).
        num_cpus = cfg.runtime.num_cpus or max(os.cpu_count() or 1, 1 + cfg.rollout.num_actors)
        self.runtime = make_runtime(cfg.runtime.type, address=cfg.runtime.address, num_cpus=num_cpus,
                                    connect_timeout_s=cfg.runtime.connect_timeout_s)
        if cfg.runtime.type == "local":
            import torch

            torch.set_num_threads(1)
        self.queue = await self._make_queue()
        trainer_gpus, trainer_device = self._placement(cfg.trainer.device)
        n = cfg.trainer.num_workers
        group_init = TrainerLink.rendezvous() if n > 1 else None  # the workers' own group meets here
        workers = await asyncio.gather(*(self.runtime.spawn(  # together: their setup joins one group
            TrainerActor, name="trainer" if n == 1 else f"trainer-{rank}", num_cpus=1, num_gpus=trainer_gpus,
            trainer=msgspec.structs.replace(cfg.trainer, device=trainer_device), sync=cfg.sync,
            model_path=self.model_path, seed=cfg.run.seed, loss=make_loss_from_config(cfg.trainer),
            advantages=grpo_advantages, queue=self.queue, engine_dtype=cfg.rollout.engine.dtype,
            torch_threads=1, rank=rank, world_size=n, group_init=group_init) for rank in range(n)))
        trainer = workers[0] if n == 1 else TrainerGroup(list(workers))
        r = cfg.rollout
        engine_gpus, engine_device = self._placement(r.engine.device)
        sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  stop_token_ids=tuple(task.stop_token_ids))
        async def spawn_rollout(i: int) -> Any:
            return await self.runtime.spawn(
                RolloutActor, name=f"rollout-{i}", num_cpus=1, num_gpus=engine_gpus,
                engine=msgspec.structs.replace(r.engine, device=engine_device), model_path=self.model_path,
                seed=cfg.run.seed + i, make_task=make_task_fn, sampling=sampling,
                max_response_tokens=r.max_response_tokens, partial_rollout=r.partial_rollout,
                next_request=next_request, absorb=absorb, queue=self.queue,
                reward_timeout_s=cfg.policy.reward_timeout_s, torch_threads=1)

        rollouts = [await spawn_rollout(i) for i in range(r.num_actors)]
        self.weight_transport = await self._open_weight_link(trainer, rollouts)
        replacement_index = itertools.count(r.num_actors)  # a replacement gets a name (and seed) of its own

        async def respawn_rollout(dead: Any) -> Any:
            """A new rollout actor for ``dead`` (its process ended: what the driver
            still holds for it is let go), its weight link open; the policy joins
            it to the broadcast group and pushes it the weights."""
            await self.runtime.stop(dead)
            new = await spawn_rollout(next(replacement_index))
            await new.open_weight_link(self.weight_transport)
            return new

        weight_sync = _test_only_stalled_push(weight_sync_fn(self.weight_transport, cfg.sync.colocated))
        self.policy = make_policy(cfg, rollouts=rollouts, trainer=trainer, queue=self.queue, task=task,
                                  weight_sync=weight_sync,
                                  respawn_rollout=respawn_rollout if r.max_respawns else None)

    def _task_kwargs(self) -> dict[str, Any]:
        """``task.kwargs`` with data files (``path``, ``eval_path``) made absolute: a
        relative one is tried against the config file's directory, then the current
        one, as ``model.path`` is (actors in other processes may run elsewhere)."""
        kwargs = {**self.cfg.task.kwargs, **self._task_data}
        for key in ("path", "eval_path"):
            value = kwargs.get(key)
            if isinstance(value, str) and value and not pathlib.Path(value).expanduser().is_absolute():
                near_config = pathlib.Path(self.cfg.base_dir) / value
                kwargs[key] = str((near_config if near_config.exists() else pathlib.Path.cwd() / value).resolve())
        return kwargs

    async def _make_queue(self) -> Any:
        """The TransferQueue and the driver's client of it. Under ``process`` and
        ``ray`` the ``local`` deployment lives in a queue-host actor, not here:
        the driver only sends control calls (statistics, close)."""
        from transfer_queue import TransferQueue
        from transfer_queue.served import QueueHost, ServedDeployment, new_secret

        q = self.cfg.transfer_queue
        if self.cfg.runtime.type == "local" or q.deployment == "ray":
            if q.deployment == "ray":
                self.runtime.connect()  # the queue's actors join the cluster the runtime uses
            return await TransferQueue.create(q)
        secret = new_secret()
        host = await self.runtime.spawn(QueueHost, q, secret, name="transfer-queue", num_cpus=0)
        return TransferQueue(q, ServedDeployment(await host.address(), secret, q.rpc_limits))

    async def _open_weight_link(self, trainer: Any, rollouts: list[Any]) -> str:
        """Pick the weight transport from where the actors run (``sync.transport``
        can force one) and open it at both ends; returns its name."""
        from sync.link import choose_transport

        where = await asyncio.gather(trainer.placement(), *(h.placement() for h in rollouts))
        kind = choose_transport(where[0], list(where[1:]), self.cfg.sync.transport)
        init = await trainer.open_weight_link(kind)
        await asyncio.gather(*(h.open_weight_link(kind) for h in rollouts))
        if kind == "dist":
            backend = self.cfg.sync.backend
            if backend == "auto":
                backend = "nccl" if all(p.device.startswith("cuda") for p in where) else "gloo"
            n = self.cfg.trainer.num_workers  # ranks 0..n-1: the trainer workers, each sends its shards
            world = n + len(rollouts)
            await asyncio.gather(trainer.join_weight_group(init, world, backend),
                                 *(h.join_weight_group(init, n + i, world, backend, n) for i, h in enumerate(rollouts)))
        return kind

    def _placement(self, device: str) -> tuple[float, str]:
        """Ray GPUs to reserve for an actor on ``device``, and the device name
        inside it (Ray shows an actor only its own GPUs, as cuda:0)."""
        if self.cfg.runtime.type != "ray" or not device.startswith("cuda"):
            return 0, device
        return (0.5 if self.cfg.sync.colocated else 1), "cuda"

    def train(self, steps: int | None = None) -> notebook.TrainResult:
        """Run ``steps`` more trainer steps (default: the rest of ``run.total_steps``;
        more than the rest raises ``run.total_steps`` to match, with a one-line notice);
        returns their records, a list whose repr is one line (:class:`~actors.notebook.TrainResult`).
        Blocks; in code already on an event loop use :meth:`train_async`. A
        KeyboardInterrupt (Ctrl-C, a notebook's stop button) stops training at the next
        step boundary (:meth:`interrupt`), then is raised: the run can train again at once."""
        steps = self._steps(steps)
        if loop.in_loop():
            raise RuntimeError("run.train() would block the loop the run lives on: `await run.train_async(steps)`")
        if self._train_call is None:  # a second call at once is refused: it must not move the budget
            notebook.extend_total_steps(self.cfg.run, self.policy.step, steps)
        call, t0 = _TrainCall(), time.perf_counter()
        try:
            records = loop.run(self._train_alone(steps, call), on_interrupt=call.interrupt)
        except KeyboardInterrupt:
            if not call.interrupted:  # raised by a SIGINT handler of the caller's own, mid-step
                raise
            raise KeyboardInterrupt(f"training stopped after step {self.policy.step}; the run can train again") from None
        return notebook.TrainResult(records, total_steps=self.cfg.run.total_steps, wall_s=time.perf_counter() - t0)

    async def train_async(self, steps: int | None = None) -> notebook.TrainResult:
        """:meth:`train` for code on an event loop (a notebook cell with ``await``):
        the steps run on the run's loop (the caller's own, or a background thread's).
        Cancelling it (a notebook's stop button cancels the cell) stops training at
        the next step boundary as an interrupt does, then CancelledError propagates."""
        steps = self._steps(steps)
        if self._train_call is None:  # a second call at once is refused: it must not move the budget
            notebook.extend_total_steps(self.cfg.run, self.policy.step, steps)
        call, t0 = _TrainCall(), time.perf_counter()
        work = self._train_alone(steps, call)
        if loop.in_loop():
            running: asyncio.Future[list[dict[str, Any]]] = asyncio.ensure_future(work)
        else:
            running = asyncio.wrap_future(loop.submit(work))
        try:  # a cancel reaches this wait only, never a step (asyncio.wait leaves ``running`` be)
            while not running.done():
                # wake now and then: Jupyter's stop button cancels this task from a signal
                # handler that does not wake the loop (ipykernel 7 on tornado)
                await asyncio.wait([running], timeout=_WAKE_S)
        except asyncio.CancelledError:
            call.interrupt()
            while not running.done():
                try:
                    await asyncio.wait([running])
                except asyncio.CancelledError:  # cancelled again: the step in progress still ends first
                    pass
            if not running.cancelled() and running.exception() is not None:
                raise running.exception() from None
            raise asyncio.CancelledError(f"training stopped after step {self.policy.step}; the run can train "
                                         "again") from None
        return notebook.TrainResult(running.result(), total_steps=self.cfg.run.total_steps,
                                    wall_s=time.perf_counter() - t0)

    def interrupt(self) -> None:
        """Stop the train call in progress at the next step boundary: the step being
        taken finishes (its push too: no engine is left paused), its record is
        written, and the call ends. Safe from any thread and from a signal handler;
        a no-op between calls."""
        call = self._train_call
        if call is not None:
            call.interrupt()

    def _steps(self, steps: int | None) -> int:
        if self._closed:
            raise RuntimeError("this run is closed")
        remaining = self.cfg.run.total_steps - self.policy.step
        return max(0, remaining) if steps is None else steps

    async def _train_alone(self, steps: int, call: _TrainCall) -> list[dict[str, Any]]:
        """:meth:`_train` as ``call``, one call at a time (two would step one trainer at once)."""
        if self._train_call is not None:
            raise RuntimeError("this run is training already (one train call at a time; run.interrupt() stops it)")
        self._train_call, call.task = call, asyncio.current_task()
        try:
            return await self._train(steps, call)
        finally:
            self._train_call = None

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop after the step in progress: write a checkpoint, then ``train``
        raises :class:`RunStopped` naming it (the command line's SIGTERM / SIGINT)."""
        self._stop_signal = signum

    async def _train(self, steps: int, call: _TrainCall) -> list[dict[str, Any]]:
        bar = None
        if self.cfg.run.progress:
            bar = notebook.progress_bar(total=len(self.history) + steps, initial=len(self.history))
        out: list[dict[str, Any]] = []
        unwritten: dict[str, Any] | None = None  # a step's record is final once the next step ends
        if self.cfg.policy.eval_every and self.initial_eval is None:  # the baseline: weights before step 1
            self.initial_eval = {"step": 0, **await self.policy.evaluate()}
            self._metrics_file.write(json.dumps(self.initial_eval) + "\n")
        every = checkpoint_every(self.cfg)
        try:
            for _ in range(steps):
                if call.interrupted:  # a step boundary: nothing of this call runs on after it
                    break
                (m,) = await self._watched(self.policy.train(1))
                if self.resumed_from is not None and m["step"] == self._resume_step + 1:
                    m["resumed_from"] = str(self.resumed_from.relative_to(self.dir))
                if unwritten is not None:
                    await self.policy.settle(unwritten["step"])  # its push (if still running) fills it in
                    self._metrics_file.write(json.dumps(unwritten) + "\n")
                unwritten = m
                self.history.append(m)
                out.append(m)
                if self._stop_signal is not None or (every and m["step"] % every == 0):
                    await self.policy.settle()  # the checkpoint holds the pushed weights' version
                    self._metrics_file.write(json.dumps(unwritten) + "\n")
                    unwritten = None
                    await self._checkpoint()
                    if self._stop_signal is not None:
                        assert self.last_checkpoint is not None
                        raise RunStopped(self._stop_signal, m["step"], self.last_checkpoint, self.dir)
                if bar is not None:
                    bar.set_postfix(reward=f"{m['reward']:.3f}", stale=f"{m['staleness_mean']:.2f}",
                                    sps=f"{m['samples_per_s']:.1f}", refresh=False)
                    bar.update(1)
            await self.policy.settle()  # the last push ends before this loop stops
        finally:
            if unwritten is not None:
                self._metrics_file.write(json.dumps(unwritten) + "\n")
            if bar is not None:
                bar.close()
        return out

    async def _watched(self, step: Any) -> Any:
        """Await one trainer step; past ``run.watchdog_s`` stop it and raise
        ``NoProgressError`` with what each part of the run was waiting on."""
        from policies.base import NoProgressError

        limit = self.cfg.run.watchdog_s
        if not limit:
            return await step
        task = asyncio.ensure_future(step)
        done, _ = await asyncio.wait([task], timeout=limit)
        if done:
            return task.result()
        waiting = await self.policy.waiting_on()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise NoProgressError(f"no trainer step finished in {limit:g} s (run.watchdog_s): {waiting}")

    def summary(self) -> dict[str, Any]:
        """First-10% vs last-10% reward, throughput and drops of the run so far, and
        the held-out eval reward before the first step and at the last evaluation."""
        h = self.history
        if not h:
            return {"steps": 0, "run_dir": str(self.dir)}
        k = max(1, len(h) // 10)
        first = sum(m["reward"] for m in h[:k]) / k
        last = sum(m["reward"] for m in h[-k:]) / k
        evals = [m for m in ([self.initial_eval] if self.initial_eval else []) + h if "eval/reward" in m]
        held_out = {} if not evals else {
            "eval_reward_first": round(evals[0]["eval/reward"], 4), "eval_reward_last": round(evals[-1]["eval/reward"], 4),
            "eval_steps": [evals[0]["step"], evals[-1]["step"]]}
        return {
            **held_out,
            "steps": len(h), "reward_first10": round(first, 4), "reward_last10": round(last, 4),
            "reward_gain": round(last - first, 4), "wall_s": round(h[-1]["elapsed_s"], 1),
            "samples_per_s": round(h[-1]["samples_per_s"], 2), "trained": h[-1]["trained"],
            "dropped": h[-1]["dropped"], "staleness_max": max(m["staleness_max"] for m in h),
            "run_dir": str(self.dir),
        }

    def __repr__(self) -> str:
        return notebook.describe(self.cfg.run.name, self.history, self.cfg.run.total_steps, self._closed, self.dir)

    def metrics(self) -> Any:
        """The steps' records so far, one row a step with ``step`` a column and nested
        counters as ``dropped/<reason>``: a pandas DataFrame when pandas is installed,
        else a list of dicts with the same columns (``actors/notebook.py``)."""
        return notebook.metrics_table(self.history)

    def plot(self, *panels: str) -> Any:
        """Plot reward (with the held-out eval reward), staleness and throughput
        against the step, or the ``panels`` named (those, or record keys such as
        ``train/loss``); returns their matplotlib Axes. Needs the ``plot`` extra."""
        return notebook.plot(self.history, self.initial_eval, panels or tuple(notebook.PANELS),
                             title=self.dir.name)

    def check(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Check the run between train calls (after an interrupt, say) and return its
        counters. Between calls rollout goes on until what may run ahead of the
        trainer is generated, then stops: this waits for that (up to ``timeout_s``),
        then raises unless produced == trained + dropped + pending and each rollout
        actor's own counts add up (``policies.base.AccountingError``), no sample is leased from the queue,
        no engine is left paused, and no task is left on the run's loop but the
        schedule's parked ones and the readers of its connections (RuntimeError
        naming the rest)."""
        if self._closed:
            raise RuntimeError("this run is closed")
        return loop.run(self._check(timeout_s))

    async def _check(self, timeout_s: float) -> dict[str, Any]:
        policy, me = self.policy, asyncio.current_task()
        if self._train_call is not None:
            raise RuntimeError("a train call is running: check the run between calls")

        def left() -> list[asyncio.Task[Any]]:
            parked = set(policy.background_tasks())
            return [t for t in asyncio.all_tasks() if t is not me and t not in parked and not t.done()
                    and _module_of(t) not in _CONNECTION_MODULES]

        deadline = time.monotonic() + timeout_s
        while (not policy.rollout_idle() or left()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        pending = await policy.check_accounting()
        leased = (await self.queue.statistics_async()).in_flight
        if leased:  # between steps the trainer holds no batch
            raise RuntimeError(f"{leased} samples still leased from the queue between train calls")
        stats = await asyncio.gather(*(h.statistics() for h in policy.rollouts))
        paused = [h.name for h, st in zip(policy.rollouts, stats) if st.get("paused")]
        if paused:
            raise RuntimeError(f"rollout actors left paused between train calls: {', '.join(paused)}")
        if not policy.rollout_idle():
            raise RuntimeError(f"rollout did not stop within {timeout_s:g} s: {policy.in_flight} samples in flight")
        policy.check_rollout_statistics(policy.rollouts, stats)  # stopped: each actor's own counters, exact
        if stray := left():
            names = ", ".join(f"{t.get_name()} ({getattr(t.get_coro(), '__qualname__', '?')})" for t in stray)
            raise RuntimeError(f"tasks left running on the run's loop between train calls: {names}")
        return {"step": policy.step, "produced": policy.produced, "trained": policy.trained,
                "dropped": sum(policy.dropped.values()), "pending": pending,
                "tasks": sorted(t.get_name() for t in policy.background_tasks())}

    def save_checkpoint(self) -> pathlib.Path:
        """Write a run checkpoint now (between ``train`` calls); returns its directory."""
        if self._closed:
            raise RuntimeError("this run is closed")
        return loop.run(self._checkpoint())

    def export_hf(self, path: str | pathlib.Path, *, dtype: str | None = None) -> pathlib.Path:
        """Write the trainer's current weights as a Hugging Face model directory
        (``actors/export.py``: config, safetensors, tokenizer, generation config);
        ``dtype`` casts them (default: as trained). Returns the directory."""
        if self._closed:
            raise RuntimeError("this run is closed")
        from actors.export import export_run

        return loop.run(export_run(self, path, dtype=dtype))

    async def _checkpoint(self) -> pathlib.Path:
        """Write ``checkpoints/step-<N>`` for the step just finished (``actors/checkpoint.py``):
        between steps, with every record up to it written and its push settled."""
        policy = self.policy
        await policy.settle()
        step = policy.step
        if self.last_checkpoint is not None and self.last_checkpoint.name == f"step-{step:06d}":
            return self.last_checkpoint  # nothing happened since
        tmp = checkpoint.new_tmp_dir(self.dir, step)
        try:
            await policy.trainer.save_state(str(tmp / "trainer"))
            queue = await self.queue.save(str(tmp / "queue.msgpack"))
            # the counters right after the queue's: samples it does not hold count as dropped in flight
            policy_state = policy.state_dict(queue)
            engine_versions = list(await asyncio.gather(*(h.get_version() for h in policy.rollouts)))
            self._metrics_file.flush()
            state = {"format_version": checkpoint.FORMAT_VERSION, "step": step, "saved_s": time.time(),
                     "policy": policy_state, "engine_versions": engine_versions,
                     "trainer_version": await policy.trainer.get_version(),
                     "driver_rng": checkpoint.driver_rng_state(), "metrics_bytes": self._metrics_file.tell()}
            (tmp / "state.json").write_text(json.dumps(state))
            (tmp / "config.yaml").write_text(to_yaml(self.cfg))
            self.last_checkpoint = checkpoint.commit(tmp, self.dir, step, self.cfg.run.keep_checkpoints)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.last_checkpoint

    async def _restore(self, ckpt: pathlib.Path) -> None:
        """Bring the freshly set up run to checkpoint ``ckpt``: trainer, queue,
        counters, engines' weights, RNG states; then its metrics and history."""
        policy = self.policy
        state = checkpoint.read_state(ckpt)
        step = state["step"]
        await policy.trainer.load_state(str(ckpt / "trainer"))
        version = await policy.trainer.get_version()
        if version != step:
            raise RuntimeError(f"checkpoint {ckpt}: the trainer's version is {version}, the run's step {step}")
        await self.queue.restore(str(ckpt / "queue.msgpack"))
        policy.load_state_dict(state["policy"])
        # the engines start on the model's own weights: the trainer's, in full (a new sender's first update)
        await policy.weight_sync(policy.rollouts, policy.trainer)
        versions = set(await asyncio.gather(*(h.get_version() for h in policy.rollouts)))
        if versions != {step}:
            raise RuntimeError(f"after the resume push the engines hold versions {sorted(versions)}, not {step}")
        await policy.check_accounting()
        checkpoint.set_driver_rng_state(state["driver_rng"])
        self._resume_step = step
        self.last_checkpoint = ckpt
        self.initial_eval, self.history = checkpoint.restore_metrics(self.dir, state["metrics_bytes"])
        checkpoint.set_aside_later(self.dir, step)
        (self.dir / "config.yaml").write_text(to_yaml(self.cfg))  # with this resume's overrides

    def close(self) -> None:
        """Stop the policy, close the queue and the actors (and a Ray cluster we started)."""
        if self._closed:
            return
        self._closed = True

        async def _close() -> None:
            call = self._train_call
            if call is not None and call.task is not None:  # its caller went away: it ends after its step
                call.interrupt()
                wait_s = 0 if self.stop_reason else _CLOSE_TRAIN_WAIT_S  # stopped early: no step to wait for
                if not (await asyncio.wait([call.task], timeout=wait_s))[0]:
                    call.task.cancel()
                await asyncio.gather(call.task, return_exceptions=True)
            if self.policy is not None:
                await self.policy.close()
            if self.queue is not None:
                await self.queue.shutdown()
            if self.runtime is not None:
                await self.runtime.shutdown()

        try:
            loop.run(_close())
        finally:
            if self._metrics_file is not None:
                self._metrics_file.close()
            if not self._discarded:
                stopped = {"stopped": self.stop_reason} if self.stop_reason else {}
                (self.dir / "summary.json").write_text(json.dumps({**self.summary(), **stopped}, indent=1))

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TrainCall:
    """One train call's stop request: set from any thread (a KeyboardInterrupt in
    the caller's, a cancelled ``train_async``), read at the call's step boundaries.
    Per call, so a request that arrives late never stops the next call."""

    def __init__(self) -> None:
        self.interrupted = False
        self.task: asyncio.Task[Any] | None = None  # on the run's loop, once it runs

    def interrupt(self) -> None:
        self.interrupted = True


_WAKE_S = 0.1  # how often train_async's caller wakes while it waits
_CLOSE_TRAIN_WAIT_S = 10.0  # close() lets a train call still running end its step this long, then cancels it
# modules whose tasks read a connection of the run's (the queue client's): they live as long as it
_CONNECTION_MODULES = ("transfer_queue.rpc",)


def _module_of(task: asyncio.Task[Any]) -> str:
    """The module of the function ``task`` runs now ("" if not known)."""
    frame = getattr(task.get_coro(), "cr_frame", None)
    return frame.f_globals.get("__name__", "") if frame is not None else ""


_DEFAULT_CONFIG = "fully_async.yaml"


def launch(config: str | pathlib.Path | None = _DEFAULT_CONFIG, *overrides: str,
           resume: str | pathlib.Path | None = None, data: Any = None, eval_data: Any = None) -> Run:
    """Load a config (plus ``key.path=value`` overrides) and start a :class:`Run`.

    ``resume``: a run directory (its newest whole checkpoint) or one checkpoint
    directory; the run continues with the checkpoint's own config (``config``
    left out), overrides only of keys a resume may change (``RESUMABLE_KEYS``).
    ``data`` / ``eval_data``: the ``text_dataset`` task's rows from Python, a
    ``datasets.Dataset`` or a list of dicts, instead of ``task.kwargs.path`` /
    ``eval_path`` (they travel to every rollout actor; pass them again to resume)."""
    task_data = {k: v for k, v in (("data", data), ("eval_data", eval_data)) if v is not None}
    if resume is None:
        return Run(load_config(config, list(overrides)), task_data=task_data)
    if config not in (None, _DEFAULT_CONFIG):
        raise ValueError("launch(resume=...) continues with the checkpoint's own config: pass overrides only")
    ckpt, cfg = resume_config(resume, list(overrides))
    return Run(cfg, resume=ckpt, task_data=task_data)


def resume_config(resume: str | pathlib.Path, overrides: list[str]) -> tuple[pathlib.Path, Config]:
    """The checkpoint to resume from and its config (with ``overrides``); a torn
    checkpoint skipped on the way is named on stderr."""
    ckpt, skipped = checkpoint.find(resume)
    for path, why in skipped:
        print(f"warning: checkpoint {path} is torn ({why}); resuming from {ckpt.name}", file=sys.stderr)
    return ckpt, load_resume_config(ckpt / "config.yaml", overrides)


def _test_only_stalled_push(weight_sync: Any) -> Any:
    """TEST ONLY (tests/test_resume.py kills a driver inside a weight push). With the
    environment variable ``ASYNCRL_TEST_ONLY_STALL_PUSH=<step>:<marker path>`` the
    push of trainer step ``<step>`` stalls with the engines paused and the update
    published: the first ``update_weights`` creates the marker file and never
    returns. Unset (outside that test), ``weight_sync`` is returned unchanged."""
    spec = os.environ.get("ASYNCRL_TEST_ONLY_STALL_PUSH")
    if not spec:
        return weight_sync
    step_text, _, marker = spec.partition(":")
    stall_step = int(step_text)

    class _StalledEngine:
        def __init__(self, handle: Any) -> None:
            self._handle = handle

        def __getattr__(self, name: str) -> Any:
            return getattr(self._handle, name)

        async def update_weights(self, update: Any) -> int:
            pathlib.Path(marker).touch()
            await asyncio.Event().wait()  # forever: the test kills this process here
            raise AssertionError("unreachable")

    async def stalled(rollouts: list[Any], trainer: Any, **kwargs: Any) -> Any:
        if await trainer.get_version() == stall_step:
            rollouts = [_StalledEngine(h) for h in rollouts]
        return await weight_sync(rollouts, trainer, **kwargs)

    return stalled


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m actors.launch",
        description="Run fully-async RL post-training from a YAML config.",
        epilog="Example: python -m actors.launch fully_async.yaml trainer.lr=2e-6 runtime.type=ray\n"
               "Every field of the config is documented where its section is declared (listed in actors/config.py).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="path to the YAML config (e.g. fully_async.yaml); not with --resume")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="dotted overrides applied after the file, e.g. trainer.lr=2e-6 runtime.type=local")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: run.total_steps)")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its newest whole checkpoint (or from the checkpoint "
                        "RUN_DIR/checkpoints/step-N named), with its own config; overrides of run.total_steps, "
                        "run.checkpoint_every, runtime.* and the like only")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, print its whole traceback (by default: one line naming what is wrong)")
    return p


# Errors that say what is wrong with the input or the machine in their message; any
# other type is named too (it is more likely a bug: --traceback shows where).
_USER_ERRORS = (ValueError, OSError, ImportError, RuntimeError)


def _error(err: BaseException, show_traceback: bool, then: str = "") -> None:
    """One line on stderr: ``error: <what is wrong>[; <then>]``."""
    if show_traceback:
        traceback.print_exception(err)
    what = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, _USER_ERRORS):
        what = f"{type(err).__name__}: {what}" + ("" if show_traceback else " (--traceback for where)")
    print(f"error: {what}" + (f"; {then}" if then else ""), file=sys.stderr)


def _resume_hint(run: Run) -> str:
    """How to go on after a run stopped on a lost actor or failing pushes."""
    if run.last_checkpoint is not None:
        return f"resume with: python -m actors.launch --resume {run.dir} (from {run.last_checkpoint.name})"
    every = checkpoint_every(run.cfg)
    return ("no checkpoint was written (run.checkpoint_every=0)" if not every
            else f"no checkpoint yet (run.checkpoint_every={every})")


class _StopNow(KeyboardInterrupt):
    """Stop at once, without a checkpoint: a second signal, the first one during
    setup, or no step boundary within ``run.stop_grace_s`` of the first. A
    KeyboardInterrupt, which the event loop lets out of a signal handler it runs."""

    def __init__(self, signum: int, why: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} {why}, without a checkpoint")
        self.signum = signum


class _StopOnSignals:
    """SIGTERM / SIGINT on the command line. The first is acknowledged on stderr at
    once and asks the run to stop after the step in progress, with a checkpoint
    (:class:`RunStopped`), or, during setup, once it is set up, before any step; a
    second one, or no such boundary within ``grace_s``, stops it at once
    (:class:`_StopNow`). While the run closes a signal ends the process. Handlers
    restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.run: Run | None = None  # set once the run is set up
        self.closing = False
        self.first: int | None = None  # the first signal's number
        self._expired = False
        self._timer: threading.Timer | None = None
        self._old: dict[int, Any] = {}

    @staticmethod
    def _say(line: str) -> None:
        os.write(2, (line + "\n").encode())  # not print(): the handler may interrupt a write to stderr

    def _expire(self) -> None:  # on the timer's thread: the handler runs on the main thread, as for a signal
        import _thread  # noqa: PLC0415 - the one use

        self._expired = True
        _thread.interrupt_main(self.first)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.closing:
            self._say(f"stopped by {name} while closing")
            os._exit(128 + signum)
        if self.first is not None:
            raise _StopNow(self.first, f"(no step boundary within {self.grace_s:g} s, run.stop_grace_s)"
                           if self._expired else f"and then {name} again")
        self.first = signum
        when = ("once the run is set up, before its first step" if self.run is None
                else f"after step {self.run.policy.step + 1} with a checkpoint")
        self._say(f"{name}: stopping {when} (within {self.grace_s:g} s, run.stop_grace_s; {name} again stops at once)")
        if self.run is not None:
            self.run.request_stop(signum)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        """The run closes now: no more waiting for a step; a signal ends the process."""
        self.closing = True
        if self._timer is not None:
            self._timer.cancel()

    def __enter__(self) -> _StopOnSignals:
        self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        for s, handler in self._old.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 after a run, 2 when the config or the setup is wrong (no
    run directory is left behind), 1 when the run stops with an error, 128 + the
    signal's number when SIGTERM / SIGINT stopped it (with a checkpoint when the
    step in progress finished in time). Each stop is one line on stderr."""
    from policies.base import ActorLostError, NoProgressError
    from policies.reward_guard import RewardsFailing
    from sync.errors import SyncFailed

    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.resume is not None:
            overrides = list(args.overrides)
            if args.config is not None:
                if "=" not in args.config:
                    raise ConfigError(f"--resume continues with the run's own config; {args.config!r} is not a "
                                      "key.path=value override")
                overrides.insert(0, args.config)
            ckpt, cfg = resume_config(args.resume, overrides)
        else:
            if args.config is None:
                parser.error("the config file is required (or --resume RUN_DIR)")
            ckpt, cfg = None, load_config(args.config, args.overrides)
    except ValueError as err:  # ConfigError, or no checkpoint to resume from
        _error(err, args.traceback)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    with _StopOnSignals(cfg.run.stop_grace_s) as signals:
        try:
            run = Run(cfg, resume=ckpt)
        except _StopNow as err:
            print(str(err), file=sys.stderr)
            return 128 + err.signum
        except Exception as err:  # noqa: BLE001 - the command line's boundary: one line, not a traceback
            _error(err, args.traceback)
            return 2
        signals.run = run
        try:
            with run:
                try:
                    if signals.first is not None:  # during setup: no step is started
                        raise _StopNow(signals.first, "during setup")
                    run.train(args.steps)
                except RunStopped as err:
                    print(str(err), file=sys.stderr)
                    run.stop_reason = str(err)
                    return 128 + err.signum
                except _StopNow as err:
                    logging.getLogger("asyncio").disabled = True  # the tasks it abandons: no "never retrieved"
                    last = f"; the last checkpoint is {run.last_checkpoint}" if run.last_checkpoint else ""
                    print(f"{err}{last}", file=sys.stderr)
                    run.stop_reason = str(err)
                    return 128 + err.signum
                except (NoProgressError, ActorLostError, SyncFailed, RewardsFailing) as err:  # one line, as the others
                    _error(err, args.traceback, _resume_hint(run))
                    run.stop_reason = " ".join(str(err).split())
                    return 1
                finally:
                    signals.close()
        finally:
            signals.close()
    print(json.dumps({"summary": run.summary()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
