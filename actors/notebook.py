"""How a :class:`~actors.launch.Run` shows itself in a notebook: its progress
bar, its one-line repr, its metrics as a table and as a plot.

Each optional library is used when it is installed and never required:
``ipywidgets`` (the notebook's progress widget; without it the text bar, and no
warning about it), ``pandas`` (the table; without it a list of dicts),
``matplotlib`` (the plot: the ``plot`` extra, named by the error without it).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["PANELS", "describe", "metrics_table", "plot", "progress_bar"]

# What ``plot`` draws by default, one panel each: (record key, label) pairs.
PANELS: dict[str, tuple[tuple[str, str], ...]] = {
    "reward": (("reward", "train reward"), ("eval/reward", "eval reward")),
    "staleness": (("staleness_mean", "mean"), ("staleness_max", "max")),
    "throughput": (("samples_per_s", "samples/s"),),
}
_YLABELS = {"staleness": "staleness (versions)", "throughput": "samples/s"}


def _tqdm_class() -> Any:
    """``tqdm.auto``'s bar: the notebook widget under Jupyter when ipywidgets is
    installed, the text bar otherwise. ``tqdm.auto`` warns ("IProgress not found")
    when it falls back in a notebook; the fallback is what we want, so not that."""
    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TqdmWarning)
        from tqdm.auto import tqdm
    return tqdm


# First here, quietly: transformers imports tqdm.auto too (through huggingface_hub),
# and whichever import comes first is the one that warns.
_tqdm_class()


def progress_bar(total: int, initial: int) -> Any:
    """A bar counting trainer steps from ``initial`` to ``total``."""
    return _tqdm_class()(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


def describe(name: str, history: Sequence[dict[str, Any]], total_steps: int, closed: bool) -> str:
    """``Run(<name>, step 12/500, reward 0.413, staleness 0.80, 95.3 samples/s)``: the latest step's figures."""
    parts = [name]
    if not history:
        parts.append(f"step 0/{total_steps}")
    else:
        m = history[-1]
        parts += [f"step {m['step']}/{total_steps}", f"reward {m['reward']:.3f}",
                  f"staleness {m['staleness_mean']:.2f}", f"{m['samples_per_s']:.1f} samples/s"]
    if closed:
        parts.append("closed")
    return f"Run({', '.join(parts)})"


def metrics_table(history: Sequence[dict[str, Any]]) -> Any:
    """The records as a pandas DataFrame indexed by step (nested counters such as
    ``dropped`` flattened to ``dropped/<reason>``) when pandas is installed, else
    a list of dicts (copies)."""
    try:
        import pandas as pd
    except ImportError:
        return [dict(m) for m in history]
    if not history:
        return pd.DataFrame()
    return pd.json_normalize(list(history), sep="/").set_index("step")


def plot(history: Sequence[dict[str, Any]], initial_eval: dict[str, Any] | None,
         panels: Sequence[str] = tuple(PANELS), *, title: str = "") -> Any:
    """One panel per name in ``panels``, against the trainer step: a name of
    :data:`PANELS` (reward with eval reward, staleness, throughput) or any
    numeric record key (``train/loss``). The held-out evaluation before the first
    step is the eval curve's first point. Returns the matplotlib Axes, one per
    panel, as pandas' ``plot`` does (``axes[0].figure`` is the Figure): a Figure
    returned to a notebook would be drawn twice."""
    try:
        import matplotlib.pyplot as plt
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
