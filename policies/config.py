"""The config sections the policies own: ``policy`` (the schedule) and ``task``
(prompts and rewards). The composition root (``actors/config.py``) composes them."""

from __future__ import annotations

from typing import Annotated, Literal, Protocol

import msgspec
from msgspec import Meta

from sync.config import SyncConfig

__all__ = ["PolicyConfig", "RunSettings", "TaskConfig"]

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The task prompts come from and rewards are computed by."""

    type: str = "reverse_digits"
    """Task name (see ``policies.tasks``): ``reverse_digits``, ``long_tail_copy``
    (symbol tasks for the built-in tiny model), ``text_dataset`` (JSONL/Parquet
    prompts and answers), ``text_arithmetic`` (generated arithmetic in words)."""
    kwargs: dict[str, int | float | str | bool] = msgspec.field(default_factory=dict)
    """Task-specific options (e.g. digit counts, a data file, a reward function).
    Not ``model_path`` nor ``reward_timeout_s``: those come from ``model.path``
    and ``policy.reward_timeout_s``."""

    def __post_init__(self) -> None:
        reserved = sorted({"model_path", "reward_timeout_s"} & set(self.kwargs))
        if reserved:
            raise ValueError(f"kwargs must not set {', '.join(reserved)} (taken from model.path and "
                             "policy.reward_timeout_s)")


class PolicyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The schedule: when prompts are admitted, batches trained and weights synced."""

    type: Literal["fully_async", "sync", "one_step_off"] = "fully_async"
    """Schedule: fully-async, synchronous on-policy, or one-step-off baseline."""
    staleness_threshold: NonNegFloat = 2.0
    """Extra samples admitted per sync window, as a fraction of the window's
    training need (0 = generate only what the next sync window trains on).
    With ``batch_order: admission`` a trained group is about this many steps
    older than the weights it trains: 2 keeps one GPU's engine busy beside the
    trainer while the lag stays small (docs/benchmarks.md, "Time to quality")."""
    require_batches: PosInt = 1
    """Batches the trainer takes per step."""
    trigger_parameter_sync_step: PosInt = 1
    """Trainer steps between weight syncs."""
    max_staleness: NonNegInt = 6
    """Trainer-side bound: drop samples whose oldest token is more than this many versions old.
    A safety net above the lag ``staleness_threshold`` sets (plus a push's and an evaluation's
    steps), so that the oldest groups, the ones admission order trains next, are not dropped."""
    batch_order: Literal["admission", "completion"] = "admission"
    """Fully-async: which groups a step trains. ``admission``: the oldest groups
    admitted and not yet trained (the step waits until they are all generated),
    as sync trains what it admitted. ``completion``: the first whole groups to
    finish generating; it biases training to short responses: a group with one
    long sample finishes last, so it is trained later, staler, or dropped as
    stale, while all-short groups (often all right or all wrong: no advantage)
    go first. The baselines train what they admitted either way."""
    reward_timeout_s: PosFloat = 30.0
    """A reward call slower than this counts as an error for its sample (a timeout)."""
    reward_workers: PosInt = 8
    """Reward calls each rollout actor runs at once, on a pool of threads the run
    never waits for at exit (an ``async def`` reward: awaited at once on the
    process's loop, this many at a time). A reward that waits (a judge model, a
    sandbox) scores a step about this many times sooner than one call at a time."""
    max_reward_error_share: Annotated[float, Meta(ge=0, le=1)] = 0.5
    """Stop the run (one line with the reward's error, exit 1) when the reward
    function fails (raises, times out) on more than this share of the last
    ``reward_error_window`` scored samples, counted from the second group on; a
    failure costs only its sample's group below it. 1.0: never stop."""
    reward_error_window: PosInt = 256
    """Scored samples :attr:`max_reward_error_share` looks back over."""
    overlap_push: bool | None = None
    """Fully-async: the trainer takes its next step while a weight push is
    applied (it waits only for the encode). ``null`` (auto): true when the
    trainer's device is none of the engines' (the push then costs the trainer
    nothing), false when they share one, where the push would compete with the
    train step for that device (docs/benchmarks.md, "Appendix: history")."""
    eval_every: NonNegInt = 0
    """Every this many trainer steps, score ``eval_prompts`` fixed held-out
    prompts (the task's ``eval_prompts``), one greedy response each, on the
    weights of that step: logged as ``eval/reward`` (with ``eval/at_trained``, the
    samples trained so far, for comparisons at equal trained samples). 0 = never."""
    eval_prompts: PosInt = 32
    """Held-out prompts per evaluation."""
    eval_overlap_steps: NonNegInt = 2
    """An evaluation runs beside training: the engines keep its step's weights
    until it ends, so the pushes due meanwhile wait for it. Fully-async: the
    trainer takes up to this many more steps on what rollout generated before
    it waits too (each adds one version to the samples' staleness: at most
    ``max_staleness - 1`` steps, so they stay trainable); the baselines wait at
    their next push. 0: the trainer waits at its next push."""


class _Run(Protocol):
    @property
    def seed(self) -> int: ...

    @property
    def log_samples_every(self) -> int: ...

    @property
    def log_samples(self) -> int: ...


class _Placed(Protocol):
    @property
    def device(self) -> str: ...


class _Rollout(Protocol):
    @property
    def n(self) -> int: ...

    @property
    def max_respawns(self) -> int: ...

    @property
    def engine(self) -> _Placed: ...


class RunSettings(Protocol):
    """What a schedule reads of the run's config (``actors.config.Config``, which
    the composition root passes; ``policies`` never imports ``actors``): its own
    sections, and a few facts of the others'."""

    @property
    def run(self) -> _Run: ...

    @property
    def task(self) -> TaskConfig: ...

    @property
    def rollout(self) -> _Rollout: ...

    @property
    def trainer(self) -> _Placed: ...

    @property
    def policy(self) -> PolicyConfig: ...

    @property
    def sync(self) -> SyncConfig: ...

    @property
    def batch_size(self) -> int:
        """Samples a trainer step takes (``trainer.batch_prompts`` groups of ``rollout.n``)."""
        ...
