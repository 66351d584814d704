"""What a notebook calls on a :class:`~actors.run.Run` besides ``train``: its
summary and one-line repr, its records as a table and a plot (drawn by
``actors/notebook.py``), a check of the run between train calls, and an export
of the trainer's weights as a Hugging Face model."""

from __future__ import annotations

import asyncio
import pathlib
import time
from typing import TYPE_CHECKING

import loop
from actors import notebook
from actors.config import Config

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from actors.training import TrainCall
    from policies.base import PolicyBase
    from transfer_queue import TransferQueue

__all__ = ["NotebookAPI"]

# modules whose tasks read a connection of the run's (the queue client's): they live as long as it
_CONNECTION_MODULES = ("transfer_queue.rpc",)


def _module_of(task: asyncio.Task[object]) -> str:
    """The module of the function ``task`` runs now ("" if not known)."""
    frame = getattr(task.get_coro(), "cr_frame", None)
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class NotebookAPI:
    """The part of :class:`~actors.run.Run` a notebook inspects it with. Reads the
    run's ``cfg``, ``dir``, ``history``, ``initial_eval``, ``policy`` and ``queue``."""

    cfg: Config
    dir: pathlib.Path
    history: list[dict[str, object]]
    initial_eval: dict[str, object] | None
    last_checkpoint: pathlib.Path | None
    policy: PolicyBase
    queue: TransferQueue
    _train_call: TrainCall | None
    _closed: bool

    def summary(self) -> dict[str, object]:
        """First-10% vs last-10% reward, throughput and drops of the run so far, the
        held-out eval reward before the first step and at the last evaluation, and
        the newest checkpoint (the final one once the run closed: ``run.save_final``)."""
        h = self.history
        if not h:
            return {"steps": 0, "run_dir": str(self.dir)}
        ckpt = {} if self.last_checkpoint is None else {"checkpoint": str(self.last_checkpoint)}
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
            "run_dir": str(self.dir), **ckpt,
        }

    def __repr__(self) -> str:
        return notebook.describe(self.cfg.run.name, self.history, self.cfg.run.total_steps, self._closed, self.dir)

    def metrics(self) -> pd.DataFrame | list[dict[str, object]]:
        """The steps' records so far, one row a step with ``step`` a column and nested
        counters as ``dropped/<reason>``: a pandas DataFrame when pandas is installed,
        else a list of dicts with the same columns (``actors/notebook.py``)."""
        return notebook.metrics_table(self.history)

    def plot(self, *panels: str) -> np.ndarray:
        """Plot reward (with the held-out eval reward), staleness and throughput
        against the step, or the ``panels`` named (those, or record keys such as
        ``train/loss``); returns their matplotlib Axes. Needs the ``plot`` extra."""
        return notebook.plot(self.history, self.initial_eval, panels or tuple(notebook.PANELS),
                             title=self.dir.name)

    def check(self, timeout_s: float = 30.0) -> dict[str, object]:
        """Check the run between train calls (after an interrupt, say) and return its
        counters. Between calls rollout goes on until what may run ahead of the
        trainer is generated, then stops: this waits for that (up to ``timeout_s``),
        then raises unless produced == trained + dropped + pending and each rollout
        actor's own counts add up (``policies.base.AccountingError``), no sample is leased from the queue,
        no engine is left paused, and no task is left on the run's loop but the
        schedule's parked ones and the readers of its connections (RuntimeError
        naming the rest). With ``rollout.engine.speculative: mtp``, ``spec_acceptance``: the
        engines' accepted drafts over their drafts so far."""
        if self._closed:
            raise RuntimeError("this run is closed")
        return loop.run(self._check(timeout_s))

    async def _check(self, timeout_s: float) -> dict[str, object]:
        policy, me = self.policy, asyncio.current_task()
        if self._train_call is not None:
            raise RuntimeError("a train call is running: check the run between calls")

        def left() -> list[asyncio.Task[object]]:
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
        drafts, accepted = notebook.draft_counts(stats)  # speculative: mtp engines
        return {"step": policy.step, "produced": policy.produced, "trained": policy.trained,
                "dropped": sum(policy.dropped.values()), "pending": pending,
                "tasks": sorted(t.get_name() for t in policy.background_tasks()),
                **({"spec_acceptance": round(accepted / drafts, 4)} if drafts else {})}

    def export_hf(self, path: str | pathlib.Path, *, dtype: str | None = None) -> pathlib.Path:
        """Write the trainer's current weights as a Hugging Face model directory
        (``actors/export.py``: config, safetensors, tokenizer, generation config);
        ``dtype`` casts them (default: as trained). Returns the directory."""
        if self._closed:
            raise RuntimeError("this run is closed")
        from actors.export import export_run  # ~1.6 s to import (transformers): only an export pays it

        return loop.run(export_run(self, path, dtype=dtype))
