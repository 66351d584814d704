"""How a :class:`~actors.launch.Run` shows itself in a notebook: its progress
bar, its one-line repr, what ``train`` returns (:class:`TrainResult`, one line
too), its metrics as a table and as a plot.

Each optional library is used when it is installed and never required (the
``notebook`` extra installs them all): ``ipywidgets`` (the notebook's progress
widget; without it the text bar, and no warning about it), ``pandas`` (the
table; without it a list of dicts with the same columns), ``matplotlib`` (the
plot: the ``plot`` extra, named by the error without it).
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tqdm import TqdmWarning

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    from tqdm import tqdm as tqdm_bar

__all__ = ["PANELS", "TrainResult", "describe", "extend_total_steps", "metrics_table", "plot", "progress_bar",
           "interactive", "setup_status", "waiting_for"]

# What ``plot`` draws by default, one panel each: (record key, label) pairs.
PANELS: dict[str, tuple[tuple[str, str], ...]] = {
    "reward": (("reward", "train reward"), ("eval/reward", "eval reward")),
    "staleness": (("staleness_mean", "mean"), ("staleness_max", "max")),
    "throughput": (("samples_per_s", "samples/s"),),
}
_YLABELS = {"staleness": "staleness (versions)", "throughput": "samples/s"}


def _tqdm_class() -> type[tqdm_bar]:
    """``tqdm.auto``'s bar: the notebook widget under Jupyter when ipywidgets is
    installed, the text bar otherwise. ``tqdm.auto`` warns ("IProgress not found")
    when it falls back in a notebook; the fallback is what we want, so not that."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TqdmWarning)
        from tqdm.auto import tqdm  # here: inside the filter that silences its warning
    return tqdm


# First here, quietly: transformers imports tqdm.auto too (through huggingface_hub),
# and whichever import comes first is the one that warns.
_tqdm_class()


def progress_bar(total: int, initial: int) -> tqdm_bar:
    """A bar counting trainer steps from ``initial`` to ``total``."""
    return _tqdm_class()(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


def interactive() -> bool:
    """Whether someone watches stderr live: a terminal, or a notebook's kernel.
    Elsewhere (a log file, a pipe) a redrawn line would stay as lines of clutter."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


class SetupStatus:
    """A bar without a count that says which phase of setup a run is in (its
    description) and, ticking every second, for how long: a slow start is never a
    still screen. Made on the running loop; gone once the run is set up (or failed)."""

    #: what runs after each phase of ``Run.startup`` ends
    NEXT = {"mps_s": "starting the runtime", "runtime_s": "loading the task", "task_s": "placing the roles",
            "roles_s": "opening the queue", "queue_s": "starting the trainer and rollout actors",
            "actors_s": "opening the weight link", "weight_link_s": "making the policy"}

    def __init__(self) -> None:
        self._bar = _tqdm_class()(total=None, desc="setup: starting the runtime", bar_format="{desc} ({elapsed})",
                                  dynamic_ncols=True, leave=False, file=sys.stderr)
        self._ticker = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._bar.refresh()

    def lap(self, phase: str) -> bool:
        """``phase`` ended: name the next one; False once none is left (setup is done)."""
        if phase not in self.NEXT:
            return False
        self._bar.set_description_str(f"setup: {self.NEXT[phase]}")
        return True

    def close(self) -> None:
        self._ticker.cancel()
        self._bar.close()


def waiting_for(rollout_stats: Sequence[dict[str, object]]) -> str:
    """What a step waits for, from its rollout actors' statistics: the samples
    being scored (``num_scoring``: queued for or in a reward call), else generation."""
    scoring = sum(int(st.get("num_scoring", 0)) for st in rollout_stats)
    return f"scoring {scoring} sample{'s' * (scoring != 1)}" if scoring else "generating"


def draft_counts(rollout_stats: Sequence[dict[str, object]]) -> tuple[int, int]:
    """``(drafted, accepted)``: the draft tokens the engines proposed and the ones they
    accepted so far, summed over the rollout actors (``rollout.engine.speculative: mtp``)."""
    return (sum(int(st.get("num_draft_tokens", 0)) for st in rollout_stats),
            sum(int(st.get("num_accepted_draft_tokens", 0)) for st in rollout_stats))


def describe(name: str, history: Sequence[dict[str, object]], total_steps: int, closed: bool, run_dir: object) -> str:
    """``Run(<name>, step 12/500, reward 0.413, staleness 0.80, N samples/s, runs/<dir>)``:
    the latest step's figures and where the run writes."""
    parts = [name]
    if not history:
        parts.append(f"step 0/{total_steps}")
    else:
        m = history[-1]
        parts += [f"step {m['step']}/{total_steps}", f"reward {m['reward']:.3f}",
                  f"staleness {m['staleness_mean']:.2f}", f"{m['samples_per_s']:.1f} samples/s"]
    parts.append(str(run_dir))
    if closed:
        parts.append("closed")
    return f"Run({', '.join(parts)})"


class TrainResult(list):
    """What ``run.train(n)`` returns: the records of the steps it took, a plain list
    to index, slice, unpack and add, whose repr is one line, so a cell ending in
    ``run.train(n)`` shows that line and not every record (``run.metrics()`` has
    them all as a table). ``total_steps``: the run's budget after the call;
    ``wall_s``: the call's wall time."""

    def __init__(self, records: Sequence[dict[str, object]], *, total_steps: int, wall_s: float) -> None:
        super().__init__(records)
        self.total_steps, self.wall_s = total_steps, wall_s

    def __repr__(self) -> str:
        if not self:
            return f"TrainResult(0 steps of {self.total_steps}, {self.wall_s:.1f} s)"
        first, last = self[0], self[-1]
        steps = f"{len(self)} step{'s' * (len(self) > 1)} ({first['step']}-{last['step']} of {self.total_steps})"
        return (f"TrainResult({steps}, reward {last['reward']:.3f}, {last['samples_per_s']:.1f} samples/s, "
                f"{self.wall_s:.1f} s)")


class _Steps(Protocol):
    total_steps: int  # the ``run`` section's


def extend_total_steps(run_cfg: _Steps, step: int, steps: int) -> None:
    """An explicit ``run.train(steps)`` at ``step`` that goes past ``run.total_steps``
    (the ``run`` section) raises it to where the call ends, visibly: one line on
    stderr, the repr's total the new one, later checkpoints' config holding it (as
    a resume's ``run.total_steps=`` override would)."""
    if step + steps > run_cfg.total_steps:
        print(f"run.total_steps: {run_cfg.total_steps} -> {step + steps} (train({steps}) from step {step})",
              file=sys.stderr)
        run_cfg.total_steps = step + steps


def _flat(record: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def metrics_table(history: Sequence[dict[str, object]]) -> pd.DataFrame | list[dict[str, object]]:
    """The records, one row a step, with the same columns with or without pandas:
    ``step`` and every record key, nested counters flattened (``dropped: {stale: 3}``
    as ``dropped/stale``). A pandas DataFrame (default index; ``step`` is a column)
    when pandas is installed, else a list of those flat dicts."""
    rows = [_flat(m) for m in history]
    try:
        import pandas as pd  # optional (the notebook and plot extras)
    except ImportError:
        return rows
    return pd.DataFrame(rows)


def plot(history: Sequence[dict[str, object]], initial_eval: dict[str, object] | None,
         panels: Sequence[str] = tuple(PANELS), *, title: str = "") -> np.ndarray:
    """One panel per name in ``panels``, against the trainer step: a name of
    :data:`PANELS` (reward with eval reward, staleness, throughput) or any
    numeric record key (``train/loss``). The held-out evaluation before the first
    step is the eval curve's first point. Returns the matplotlib Axes, one per
    panel, as pandas' ``plot`` does (``axes[0].figure`` is the Figure): a Figure
    returned to a notebook would be drawn twice."""
    try:
        import matplotlib.pyplot as plt  # optional (the plot extra)
    except ImportError as err:
        raise ImportError("run.plot() needs matplotlib: pip install 'asyncrl[plot]' (the plot extra)") from err
    if not panels:
        raise ValueError("plot: name at least one panel")
    records = ([initial_eval] if initial_eval else []) + list(history)
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(7, 2.2 * len(panels)), layout="constrained")
    for ax, panel in zip(axes[:, 0], panels):
        curves = PANELS.get(panel, ((panel, panel),))
        drawn = 0
        for key, label in curves:
            points = [(m["step"], m[key]) for m in records if isinstance(m.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), label=label, marker="." if len(points) < 30 else None)
                drawn += 1
        if not drawn and panel not in PANELS:
            raise ValueError(f"plot: no record has a number under {panel!r} (panels: {', '.join(PANELS)}, "
                             "or a record key such as train/loss)")
        ax.set_ylabel(_YLABELS.get(panel, panel))
        ax.grid(alpha=0.3)
        if drawn > 1:
            ax.legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("trainer step")
    if title:
        fig.suptitle(title)
    return axes[:, 0]
