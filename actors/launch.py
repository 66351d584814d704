"""Start a run: ``python -m actors.launch fully_async.yaml [key.path=value ...]``.

From a notebook::

    from actors.launch import launch
    run = launch("fully_async.yaml", "trainer.lr=2e-6")
    run.train(steps=10)      # step by step; call again to continue
    run.close()

Inside an existing Ray cluster: ``runtime.type=ray runtime.address=auto``
(the cluster is joined, never shut down by the run).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import pathlib
import shutil
import sys
import time
import traceback
from typing import Any

import loop
from actors.config import Config, ConfigError, load_config, to_yaml

__all__ = ["Run", "launch", "main"]


class Run:
    """A live run: actors placed, queue open, policy ready. Methods are
    synchronous (they drive the process's one loop) so notebooks can call them."""

    def __init__(self, cfg: Config) -> None:
        from actors.models import resolve_model_path

        self.cfg = cfg
        # a wrong model path fails before anything is created on disk
        self.model_path = str(resolve_model_path(cfg.model.path, cfg.base_dir))
        made = self._make_dir()  # what this run created on disk: removed again if setup fails
        (self.dir / "config.yaml").write_text(to_yaml(cfg))
        self.history: list[dict[str, Any]] = []
        self._metrics_file = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._closed = False
        self._discarded = False  # setup failed: no summary, the run directory removed
        self.runtime: Any = None
        self.policy: Any = None
        self.queue: Any = None
        self.weight_transport = ""  # chosen by placement at setup (sync.link.choose_transport)
        self.initial_eval: dict[str, Any] | None = None  # held-out eval before the first step (policy.eval_every)
        try:
            loop.run(self._setup())
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
        self.runtime = make_runtime(cfg.runtime.type, address=cfg.runtime.address, num_cpus=num_cpus)
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
        rollouts = [
            await self.runtime.spawn(
                RolloutActor, name=f"rollout-{i}", num_cpus=1, num_gpus=engine_gpus,
                engine=msgspec.structs.replace(r.engine, device=engine_device), model_path=self.model_path,
                seed=cfg.run.seed + i, make_task=make_task_fn, sampling=sampling,
                max_response_tokens=r.max_response_tokens, partial_rollout=r.partial_rollout,
                next_request=next_request, absorb=absorb, queue=self.queue,
                reward_timeout_s=cfg.policy.reward_timeout_s, torch_threads=1)
            for i in range(r.num_actors)
        ]
        self.weight_transport = await self._open_weight_link(trainer, rollouts)
        self.policy = make_policy(cfg, rollouts=rollouts, trainer=trainer, queue=self.queue, task=task,
                                  weight_sync=weight_sync_fn(self.weight_transport, cfg.sync.colocated))

    def _task_kwargs(self) -> dict[str, Any]:
        """``task.kwargs`` with data files (``path``, ``eval_path``) made absolute: a
        relative one is tried against the config file's directory, then the current
        one, as ``model.path`` is (actors in other processes may run elsewhere)."""
        kwargs = dict(self.cfg.task.kwargs)
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

    def train(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Run ``steps`` more trainer steps (default: the rest of ``run.total_steps``)."""
        if self._closed:
            raise RuntimeError("this run is closed")
        remaining = self.cfg.run.total_steps - len(self.history)
        steps = remaining if steps is None else steps
        return loop.run(self._train(steps))

    async def _train(self, steps: int) -> list[dict[str, Any]]:
        bar = None
        if self.cfg.run.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(self.history) + steps, initial=len(self.history), unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        out: list[dict[str, Any]] = []
        unwritten: dict[str, Any] | None = None  # a step's record is final once the next step ends
        if self.cfg.policy.eval_every and self.initial_eval is None:  # the baseline: weights before step 1
            self.initial_eval = {"step": 0, **await self.policy.evaluate()}
            self._metrics_file.write(json.dumps(self.initial_eval) + "\n")
        try:
            for _ in range(steps):
                (m,) = await self._watched(self.policy.train(1))
                if unwritten is not None:
                    await self.policy.settle(unwritten["step"])  # its push (if still running) fills it in
                    self._metrics_file.write(json.dumps(unwritten) + "\n")
                unwritten = m
                self.history.append(m)
                out.append(m)
                every = self.cfg.trainer.checkpoint_every
                if every and len(self.history) % every == 0:
                    await self.policy.trainer.save(str(self.dir / f"checkpoint-{len(self.history)}"))
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

    def save_checkpoint(self, path: str | None = None) -> str:
        path = path or str(self.dir / f"checkpoint-{len(self.history)}")
        loop.run(self.policy.trainer.save(path))
        return path

    def close(self) -> None:
        """Stop the policy, close the queue and the actors (and a Ray cluster we started)."""
        if self._closed:
            return
        self._closed = True

        async def _close() -> None:
            if self.policy is not None:
                await self.policy.close()
            if self.queue is not None:
                await self.queue.shutdown()
            if self.runtime is not None:
                await self.runtime.shutdown()

        try:
            loop.run(_close())
        finally:
            self._metrics_file.close()
            if not self._discarded:
                (self.dir / "summary.json").write_text(json.dumps(self.summary(), indent=1))

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(config: str | pathlib.Path | None = "fully_async.yaml", *overrides: str) -> Run:
    """Load a config (plus ``key.path=value`` overrides) and start a :class:`Run`."""
    return Run(load_config(config, list(overrides)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m actors.launch",
        description="Run fully-async RL post-training from a YAML config.",
        epilog="Example: python -m actors.launch fully_async.yaml trainer.lr=2e-6 runtime.type=ray\n"
               "Every field of the config is documented where its section is declared (listed in actors/config.py).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="path to the YAML config (e.g. fully_async.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="dotted overrides applied after the file, e.g. trainer.lr=2e-6 runtime.type=local")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: run.total_steps)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, print its whole traceback (by default: one line naming what is wrong)")
    return p


# Errors that say what is wrong with the input or the machine in their message; any
# other type is named too (it is more likely a bug: --traceback shows where).
_USER_ERRORS = (ValueError, OSError, ImportError, RuntimeError)


def _error(err: BaseException, show_traceback: bool) -> None:
    """One line on stderr: ``error: <what is wrong>``."""
    if show_traceback:
        traceback.print_exception(err)
    what = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, _USER_ERRORS):
        what = f"{type(err).__name__}: {what}" + ("" if show_traceback else " (--traceback for where)")
    print(f"error: {what}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 after a run, 2 when the config or the setup is wrong (no
    run directory is left behind), 1 when the run stops with an error."""
    from policies.base import NoProgressError

    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        _error(err, args.traceback)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    try:
        run = Run(cfg)
    except Exception as err:  # noqa: BLE001 - the command line's boundary: one line, not a traceback
        _error(err, args.traceback)
        return 2
    with run:
        try:
            run.train(args.steps)
        except NoProgressError as err:
            _error(err, args.traceback)
            return 1
    print(json.dumps({"summary": run.summary()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
