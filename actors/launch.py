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
import json
import os
import pathlib
import sys
import time
from typing import Any

import loop
from actors.config import Config, ConfigError, load_config, to_yaml

__all__ = ["Run", "launch", "main"]


def _weight_sync_fn(cfg: Config) -> Any:
    from actors.weight_group import ActorBroadcast
    from sync.sequence import sync_weights

    async def weight_sync(rollouts: list[Any], trainer: Any, released: asyncio.Event | None = None) -> Any:
        if cfg.sync.transport == "broadcast":
            # the trainer sends the payload itself: it is free to step only once that is done
            transport = ActorBroadcast(trainer)
            try:
                return await sync_weights(rollouts, trainer, colocated=cfg.sync.colocated,
                                          transport=transport)
            finally:
                await transport.wait()
                if released is not None:
                    released.set()
        try:
            return await sync_weights(rollouts, trainer, colocated=cfg.sync.colocated, released=released)
        finally:
            if cfg.sync.transport == "cuda_ipc":  # the engines hold no mapping of the buckets any more
                await trainer.release_shared_buckets()

    return weight_sync


class Run:
    """A live run: actors placed, queue open, policy ready. Methods are
    synchronous (they drive the process's one loop) so notebooks can call them."""

    def __init__(self, cfg: Config) -> None:
        from actors.models import resolve_model_path

        self.cfg = cfg
        # a wrong model path fails before anything is created on disk
        self.model_path = str(resolve_model_path(cfg.model.path, cfg.base_dir))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.dir = pathlib.Path(cfg.run.output_dir) / f"{cfg.run.name}-{stamp}-{os.getpid()}"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(to_yaml(cfg))
        self.history: list[dict[str, Any]] = []
        self._metrics_file = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._closed = False
        self.runtime: Any = None
        self.policy: Any = None
        self.queue: Any = None
        try:
            loop.run(self._setup())
        except BaseException:
            self.close()
            raise

    async def _setup(self) -> None:
        from actors.engines.base import SamplingParams
        from actors.rollout import RolloutActor
        from actors.runtime import make_runtime
        from actors.trainer import TrainerActor
        from policies import make_policy
        from policies.tasks import make_task
        from transfer_queue import TransferQueue, TransferQueueConfig

        cfg = self.cfg
        model_path = self.model_path
        task = make_task(cfg.task.type, **cfg.task.kwargs)
        # A cluster we start gets at least one logical CPU per actor, so a
        # laptop with fewer cores than actors still places them all (oversubscribed).
        num_cpus = cfg.runtime.num_cpus or max(os.cpu_count() or 1, 1 + cfg.rollout.num_actors)
        self.runtime = make_runtime(cfg.runtime.type, address=cfg.runtime.address, num_cpus=num_cpus)
        threads = 1 if cfg.runtime.type == "local" else None
        if threads:
            import torch

            torch.set_num_threads(threads)
        t = cfg.trainer
        trainer_gpus, trainer_device = self._placement(t.device)
        trainer = await self.runtime.spawn(
            TrainerActor, name="trainer", num_cpus=1, num_gpus=trainer_gpus,
            backend=t.backend, model_path=model_path,
            backend_kwargs=dict(device=trainer_device, dtype=t.dtype, master_dtype=t.master_dtype, lr=t.lr,
                                weight_decay=t.weight_decay,
                                grad_clip=t.grad_clip, loss=t.loss,
                                loss_kwargs=_loss_kwargs(cfg), seed=cfg.run.seed,
                                micro_batch_tokens=t.micro_batch_tokens),
            sync_kwargs=dict(mode=cfg.sync.mode, bucket_bytes=cfg.sync.bucket_bytes,
                             full_every_k=cfg.sync.full_every_k or None,
                             dtype=cfg.rollout.engine.dtype),
            torch_threads=1)
        r, e = cfg.rollout, cfg.rollout.engine
        engine_gpus, engine_device = self._placement(e.device)
        sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  stop_token_ids=tuple(task.stop_token_ids))
        rollouts = [
            await self.runtime.spawn(
                RolloutActor, name=f"rollout-{i}", num_cpus=1, num_gpus=engine_gpus,
                engine_type=e.type, model_path=model_path,
                engine_kwargs=dict(device=engine_device, dtype=e.dtype, max_num_seqs=e.max_num_seqs,
                                   max_model_len=e.max_model_len, seed=cfg.run.seed + i,
                                   cuda_graphs=e.cuda_graphs, compile_decode=e.compile_decode),
                task_type=cfg.task.type, task_kwargs=dict(cfg.task.kwargs), sampling=sampling,
                max_response_tokens=r.max_response_tokens, partial_rollout=r.partial_rollout,
                reward_timeout_s=cfg.policy.reward_timeout_s, torch_threads=1)
            for i in range(r.num_actors)
        ]
        if cfg.sync.transport == "broadcast":
            from actors.weight_group import free_port

            init = f"tcp://127.0.0.1:{free_port()}"
            world = 1 + len(rollouts)
            await asyncio.gather(
                trainer.join_weight_group(init, world, cfg.sync.backend),
                *(h.join_weight_group(init, 1 + i, world, cfg.sync.backend) for i, h in enumerate(rollouts)))
        elif cfg.sync.transport == "cuda_ipc":
            await trainer.share_by_cuda_ipc()
        # after the actors: a Ray deployment joins the cluster the runtime started
        q = cfg.transfer_queue
        self.queue = await TransferQueue.create(TransferQueueConfig(
            capacity=q.capacity, num_storage_units=q.num_storage_units, lease_s=q.lease_s,
            deployment=q.deployment, ports=q.ports))
        self.policy = make_policy(cfg, rollouts=rollouts, trainer=trainer, queue=self.queue, task=task,
                                  weight_sync=_weight_sync_fn(cfg))

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
        try:
            for _ in range(steps):
                (m,) = await self.policy.train(1)
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

    def summary(self) -> dict[str, Any]:
        """First-10% vs last-10% reward, throughput and drops of the run so far."""
        h = self.history
        if not h:
            return {"steps": 0, "run_dir": str(self.dir)}
        k = max(1, len(h) // 10)
        first = sum(m["reward"] for m in h[:k]) / k
        last = sum(m["reward"] for m in h[-k:]) / k
        return {
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
            (self.dir / "summary.json").write_text(json.dumps(self.summary(), indent=1))

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _loss_kwargs(cfg: Config) -> dict[str, float]:
    t = cfg.trainer
    if t.loss == "ppo_clip":
        return {"clip_eps_low": t.clip_eps, "clip_eps_high": t.clip_eps}
    if t.loss == "decoupled_ppo":
        return {"clip_eps_low": t.clip_eps, "clip_eps_high": t.clip_eps, "behav_weight_cap": t.is_cap}
    return {"cap": t.is_cap}


def launch(config: str | pathlib.Path | None = "fully_async.yaml", *overrides: str) -> Run:
    """Load a config (plus ``key.path=value`` overrides) and start a :class:`Run`."""
    return Run(load_config(config, list(overrides)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m actors.launch",
        description="Run fully-async RL post-training from a YAML config.",
        epilog="Example: python -m actors.launch fully_async.yaml trainer.lr=2e-6 runtime.type=ray\n"
               "Every field of the config is documented in actors/config.py.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="path to the YAML config (e.g. fully_async.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="dotted overrides applied after the file, e.g. trainer.lr=2e-6 runtime.type=local")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: run.total_steps)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    try:
        run = Run(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with run:
        run.train(args.steps)
    print(json.dumps({"summary": run.summary()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
