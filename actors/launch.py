"""Start a run: ``python -m actors.launch fully_async.yaml [key.path=value ...]``;
continue one: ``python -m actors.launch --resume runs/<dir> [run.total_steps=...]``.

From a notebook::

    from actors.launch import launch
    run = launch("fully_async.yaml", "trainer.lr=2e-6")
    run.train(steps=10)      # step by step; call again to continue
    run = launch("fully_async.yaml", "task.type=text_dataset", data=ds, reward=my_reward)  # your rows and reward
    await run.train_async(10)       # the same from code on an event loop
    run                      # Run(fully_async, step 20/500, reward 0.41, staleness 0.80, N samples/s, runs/...)
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
``run.stop_grace_s``, stops at once, without one: :class:`~actors.cli._StopOnSignals`). A
checkpoint is taken between steps: weight push finished, no batch leased.
Samples still being generated then are not saved: a run resumed from it counts
them dropped, ``in_flight_at_checkpoint`` (``PolicyBase.state_dict``). Resuming
rebuilds the run from the checkpoint's config, loads the trainer, pushes its
weights in full to the engines, restores counters, RNG states and the queue's
samples, and goes on numbering steps and appending to ``metrics.jsonl`` (records
of steps after the checkpoint, lost with the process, move to
``metrics.rolled_back.jsonl``).

This module is the entry; the composition root it opens is split by concern:

    actors/run.py            Run: set up from a config, closed at the end
    actors/wiring.py         the runtime, queue, actors, weight link and policy built from the config
    actors/training.py       the training loop: train, train_async, interrupt, stop requests
    actors/resume.py         checkpoints of a live run, and resuming from one
    actors/notebook_api.py   summary, repr, metrics, plot, check, export_hf
    actors/cli.py            the command line: arguments, signals, one line per way a run stops
    actors/config.py         the typed config (actors/config_yaml.py reads its YAML and overrides)
"""

from __future__ import annotations

import inspect
import pathlib
import sys
from collections.abc import Callable, Iterable, Mapping

from actors.cli import main
from actors.config import Config, load_config
from actors.resume import resume_config
from actors.run import Run
from actors.training import RunStopped
from policies.rewards import reward_form, reward_name
from policies.tasks import task_factory

__all__ = ["Run", "RunStopped", "launch", "main"]

#: The process runtime's children need nothing defined here: spawn does not import this
#: module (and torch with it) again in each of them (actors.runtime.process._main_kept_out).
SPAWN_IMPORTS_MAIN = False

_DEFAULT_CONFIG = "fully_async.yaml"


def launch(config: str | pathlib.Path | None = _DEFAULT_CONFIG, *overrides: str,
           resume: str | pathlib.Path | None = None, data: Iterable[Mapping[str, object]] | None = None,
           eval_data: Iterable[Mapping[str, object]] | None = None,
           reward: Callable[..., object] | None = None) -> Run:
    """Load a config (plus ``key.path=value`` overrides) and start a :class:`Run`.

    ``resume``: a run directory (its newest whole checkpoint) or one checkpoint
    directory; the run continues with the checkpoint's own config (``config``
    left out), overrides only of keys a resume may change (``RESUMABLE_KEYS``).
    ``data`` / ``eval_data``: the ``text_dataset`` task's rows from Python, a
    ``datasets.Dataset`` or a list of dicts, instead of ``task.kwargs.path`` /
    ``eval_path`` (they travel to every rollout actor; pass them again to resume).
    ``reward``: the task's reward as a Python function in any form of
    ``policies.rewards`` (TRL's ``fn(completions, **kwargs)`` among them), instead of
    ``task.kwargs.reward``, which records its ``module:qualname``; it travels to every
    rollout actor like ``data`` (pass it again to resume)."""
    task_data = {k: v for k, v in (("data", data), ("eval_data", eval_data)) if v is not None}
    if resume is None:
        cfg, ckpt = load_config(config, list(overrides)), None
    else:
        if config not in (None, _DEFAULT_CONFIG):
            raise ValueError("launch(resume=...) continues with the checkpoint's own config: pass overrides only")
        ckpt, cfg = resume_config(resume, list(overrides))
    if reward is not None:
        task_data["reward"] = _reward_function(cfg, reward)
    return Run(cfg, resume=ckpt, task_data=task_data)


def _reward_function(cfg: Config, reward: Callable[..., object]) -> Callable[..., object]:
    """``reward`` checked (a function the task takes, in a form :mod:`policies.rewards`
    knows) and recorded in ``cfg.task.kwargs.reward`` by name, for the saved config
    and the run's errors; ``ValueError`` naming ``launch(reward=...)`` otherwise."""
    if not callable(reward):
        raise ValueError(f"launch(reward=...): expected a function, got {type(reward).__name__} {reward!r:.80} "
                         "(a name or a file.py:function goes in task.kwargs.reward)")
    factory = task_factory(cfg.task.type)
    try:
        takes = "reward" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes = True  # a builtin or C callable: its options are checked when it is built
    if not takes:
        raise ValueError(f"launch(reward=...): task {cfg.task.type!r} takes no reward function; "
                         "set task.type=text_dataset (or text_arithmetic)")
    try:
        reward_form(reward)
    except ValueError as err:
        raise ValueError(f"launch(reward=...): {err}") from None
    cfg.task.kwargs["reward"] = reward_name(reward)
    return reward


if __name__ == "__main__":
    sys.exit(main())
