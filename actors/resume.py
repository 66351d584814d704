"""Checkpoints of a live :class:`~actors.run.Run` and resuming from one (the
on-disk format, written atomically and checked on the way back, is
``actors/checkpoint.py``). A checkpoint is taken between steps: weight push
finished, no batch leased. Resuming rebuilds the run from the checkpoint's config
(:func:`resume_config`), then brings it to the checkpoint (``_restore``): trainer,
queue, counters, the engines' weights (pushed in full), RNG states, metrics."""

from __future__ import annotations

import asyncio
import json
import pathlib
import shutil
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.loggers import MetricsLog
    from policies.base import PolicyBase
    from transfer_queue import TransferQueue

import loop
from actors import checkpoint
from actors.config import Config, load_resume_config, to_yaml

__all__ = ["Checkpointing", "resume_config"]


def resume_config(resume: str | pathlib.Path, overrides: list[str]) -> tuple[pathlib.Path, Config]:
    """The checkpoint to resume from and its config (with ``overrides``); a torn
    checkpoint skipped on the way is named on stderr."""
    ckpt, skipped = checkpoint.find(resume)
    for path, why in skipped:
        print(f"warning: checkpoint {path} is torn ({why}); resuming from {ckpt.name}", file=sys.stderr)
    return ckpt, load_resume_config(ckpt / "config.yaml", overrides)


class Checkpointing:
    """The part of :class:`~actors.run.Run` that checkpoints it and restores it
    from a checkpoint. Uses the run's ``cfg``, ``dir``, ``policy``, ``queue`` and
    ``_metrics_file``; sets the state below."""

    cfg: Config
    dir: pathlib.Path
    policy: PolicyBase
    queue: TransferQueue
    history: list[dict[str, object]]
    initial_eval: dict[str, object] | None
    last_checkpoint: pathlib.Path | None
    _metrics_file: MetricsLog
    _resume_step: int
    _closed: bool
    _train_failed: bool  # a train call ended on an error: no final checkpoint

    def save_checkpoint(self) -> pathlib.Path:
        """Write a run checkpoint now (between ``train`` calls); returns its directory."""
        if self._closed:
            raise RuntimeError("this run is closed")
        return loop.run(self._checkpoint())

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
            policy.mark_checkpoint()
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

    async def _save_final(self) -> pathlib.Path | None:
        """The run closes: write the checkpoint of its last step (``run.save_final``)
        unless it trained no step, a checkpoint of that step exists, or training
        stopped on an error (the step's state may be torn: the last checkpoint stands)."""
        if (not self.cfg.run.save_final or self._train_failed or self.policy is None or self.policy.step == 0
                or self.policy.step == self._resume_step):
            return None
        return await self._checkpoint()

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
