"""Typed run configuration: ``fully_async.yaml`` decoded into msgspec Structs.

Each section lives with the component that takes it, and holds the one set of
defaults of that component; this module composes them (it is part of the
composition root: nothing but the composition root (``actors/launch.py`` and the
modules it is split into), tools, benchmarks and tests imports it):

    run, runtime, model   here
    task, policy          policies/config.py        (TaskConfig, PolicyConfig)
    rollout               actors/rollout_config.py  (RolloutConfig; .engine: actors/engines/config.py EngineConfig)
    trainer               actors/backends/config.py (TrainerConfig)
    transfer_queue        transfer_queue/config.py  (TransferQueueConfig)
    sync                  sync/config.py            (SyncConfig)

Every field is documented where it is declared and bounded where a bound
exists. Unknown keys, wrong types and out-of-range values are
:class:`ConfigError` naming the dotted path (``trainer.lr: expected float,
got str``); so are engine and backend types this build does not have. After
:func:`load_config` no raw dict survives. The YAML file and the dotted overrides
are read into a raw tree by ``actors/config_yaml.py``.

The ``auto`` values (``trainer.dtype``, ``trainer.kernels``, ``trainer.cuda_graphs``,
``rollout.engine.dtype`` and ``max_num_seqs``: the fast settings on a GPU) are
resolved once, by their section as :func:`build_config` decodes it, so the checks
here, every actor and the saved config see concrete values.
"""

from __future__ import annotations

import inspect
import math
import pathlib
import re
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

from actors.backends.config import TrainerConfig
from actors.backends.kernels import kernels_unavailable
from actors.backends.registry import backend_unavailable
from actors.config_errors import friendly
from actors.config_yaml import ConfigError, apply_overrides, read_yaml
from actors.engines.config import EngineConfig
from actors.engines.registry import engine_unavailable
from actors.loggers import loggers_unavailable
from actors.mps import mps_unavailable
from actors.placement_config import PlacementConfig
from actors.rollout_config import RolloutConfig
from policies.admission import window_budget
from policies.config import PolicyConfig, TaskConfig
from policies.rewards import anchor_reward_spec, reward_form
from policies.tasks import CONTEXT_OPTIONS, task_factory
from sync.config import SyncConfig
from transfer_queue.config import TransferQueueConfig

__all__ = [
    "Config",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "PolicyConfig",
    "RolloutConfig",
    "RunConfig",
    "RuntimeConfig",
    "SyncConfig",
    "TaskConfig",
    "TrainerConfig",
    "TransferQueueConfig",
    "apply_overrides",
    "checkpoint_every",
    "load_config",
    "load_resume_config",
    "load_saved_config",
    "to_yaml",
]

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunConfig(_Section):
    name: str = "fully_async"
    """Run name; the run directory is ``output_dir/name-<timestamp>``."""
    output_dir: str = "runs"
    """Where run directories are created (relative to the working directory)."""
    seed: NonNegInt = 0
    """Seeds prompts, sampling and initialisation."""
    total_steps: PosInt = 200
    """Trainer steps (optimizer steps) of the run."""
    progress: bool = True
    """Show a progress bar on stderr."""
    watchdog_s: Annotated[float, Meta(ge=0)] = 1800.0
    """A trainer step that does not finish within this many seconds stops the run
    with ``NoProgressError``, saying what each part was waiting on (0 = never)."""
    stop_grace_s: Annotated[float, Meta(gt=0)] = 30.0
    """The command line, on SIGTERM / SIGINT: how long to wait for the step in
    progress to finish (then a checkpoint, exit 128 + the signal) before it stops
    without them."""
    checkpoint_every: NonNegInt = 0
    """Write a run checkpoint every this many trainer steps (0 = never; the command
    line also writes one when stopped by SIGTERM or SIGINT). A run checkpoint
    (``<run dir>/checkpoints/step-<N>``) holds what ``--resume`` needs: the
    trainer's HF-loadable weights and optimizer, RNG states, counters, the
    queue's samples, the resolved config."""
    save_final: bool = True
    """Write a run checkpoint of the last step when the run closes after training
    (unless one of that step exists or training failed), so that ``python -m
    actors.export <run dir> <out>`` and ``python -m actors.evaluate <run dir>``
    work on every finished run. On the built-in tiny model it takes well under a second."""
    log_samples_every: NonNegInt = 10
    """Every this many trainer steps (and at step 1), write ``log_samples`` of the
    step's trained samples (prompt, completion, reward) to ``<run dir>/samples.jsonl``
    and, with the ``tensorboard`` logger, as text under ``samples`` (0 = never)."""
    log_samples: NonNegInt = 4
    """How many samples each such step writes (spread over the batch's groups)."""
    keep_checkpoints: Annotated[int, Meta(ge=2)] = 2
    """Run checkpoints kept: older ones are deleted once a newer one is complete
    (at least 2, so a checkpoint torn by a crash leaves the previous one)."""
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)
    """Where metrics go, all under the same names (the keys of ``metrics.jsonl``
    records, nested ones as ``key/sub``) at the run's step, the resolved config
    logged as hyperparameters (``actors/loggers.py``): ``jsonl`` (``metrics.jsonl``;
    required: resume and the summary read it), ``tensorboard`` (``<run dir>/tensorboard``;
    extra ``[tensorboard]``), ``wandb`` (``<run dir>/wandb``; extra ``[wandb]``)."""
    wandb_project: str = "asyncrl"
    """The W&B project of ``loggers: [..., wandb]``."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline``: the W&B run is written under the run directory only (no network,
    no login; ``wandb sync`` uploads it later). ``online``: streamed to W&B (log in first)."""


class RuntimeConfig(_Section):
    type: Literal["local", "process", "ray"] = "local"
    """``local``: actors live in this process, each with one worker thread.
    ``process``: each actor in a child process of its own (no Ray needed; the
    actors' Python no longer shares one GIL). ``ray``: each actor is a Ray actor."""
    address: str | None = None
    """Ray only. ``auto`` joins the cluster Ray finds (``RAY_ADDRESS``, else the one a
    ``ray start`` on this machine recorded, else a Ray node running here);
    ``host:port`` joins the cluster whose head's GCS listens there (``ray start
    --head`` prints it); ``ray://host:port`` joins through Ray Client. A joined
    cluster is never shut down by us. ``None`` starts a local cluster for the run
    and stops it at the end. No cluster to join is an error, never a new cluster."""
    connect_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    """Ray only, with ``address``: how long to wait for the cluster to answer before
    the run stops with one line naming the address (``ray.init`` itself would wait
    for minutes on an address where nothing answers)."""
    num_cpus: PosInt | None = None
    """Ray only, for a cluster we start: logical CPUs to give it (default: the
    machine's cores, at least one per actor)."""
    mps: bool = False
    """``process`` only, actors on GPUs: the run starts an NVIDIA MPS control daemon of
    its own before its actors (stopped when it closes), so the actors' CUDA contexts
    are clients of one MPS server and a colocated trainer's kernels run beside the
    engine's instead of taking turns with them (``actors/mps.py``; what it changes
    is measured in docs/benchmarks.md). A daemon the environment already names
    (``CUDA_MPS_PIPE_DIRECTORY``) is used as it is."""
    mps_trainer_sm_percent: Annotated[int, Meta(ge=1, le=100)] | None = None
    """With ``mps``: the share of the GPU's SMs the trainer's kernels may take
    (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` in its processes), so that the engine's
    always find SMs free (unlimited, the trainer beside the engine slows the
    engine's prefills several times over: docs/benchmarks.md). None: no limit."""
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    """Ray only: what each role asks of the cluster and how it spreads over its
    nodes (``actors/placement_config.py``; ``docs/ray-clusters.md``)."""


class ModelConfig(_Section):
    path: str = "actors/assets/tiny-qwen2"
    """A Hugging Face causal-LM directory (config.json, safetensors, tokenizer).
    Relative paths resolve against the config file's directory."""
    mtp_layers: NonNegInt = 0
    """Multi-token prediction modules (``docs/mtp.md``): 0 none. K > 0: module k (an
    embedding-and-hidden projection, one decoder layer, the shared head) predicts the
    token k + 2 ahead; loaded from the checkpoint where it has them (``mtp.{k}.*``),
    else added, initialised from the last decoder layer. The trainer trains them
    (``trainer.mtp_loss_weight``), every push carries them, and the built-in engine
    drafts with them (``rollout.engine.speculative: mtp``)."""


class Config(_Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    transfer_queue: TransferQueueConfig = msgspec.field(default_factory=TransferQueueConfig)
    sync: SyncConfig = msgspec.field(default_factory=SyncConfig)
    base_dir: str = "."
    """Directory of the config file (relative paths resolve against it); set by the loader."""

    @property
    def batch_size(self) -> int:
        return self.trainer.batch_prompts * self.rollout.n


# runtime.address: 'auto', or host:port (a name, IPv4 or [IPv6]), ray:// in front for Ray Client
_RAY_ADDRESS = re.compile(r"auto|(ray://)?([A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})")


def _check_consistency(cfg: Config) -> None:
    # before anything is built or a run directory exists: a type this build cannot construct
    if (reason := engine_unavailable(cfg.rollout.engine)) is not None:
        raise ConfigError(f"rollout.engine.type: {reason}")
    if (reason := backend_unavailable(cfg.trainer)) is not None:
        raise ConfigError(f"trainer.backend: {reason}")
    if (reason := kernels_unavailable(cfg.trainer.kernels, cfg.trainer.device)) is not None:
        raise ConfigError(f"trainer.kernels: {reason}")
    if (reason := loggers_unavailable(cfg.run.loggers)) is not None:
        raise ConfigError(f"run.loggers: {reason}")
    if cfg.rollout.max_response_tokens >= cfg.rollout.engine.max_model_len:
        raise ConfigError(
            f"rollout.max_response_tokens: {cfg.rollout.max_response_tokens} leaves no room for "
            f"the prompt in rollout.engine.max_model_len={cfg.rollout.engine.max_model_len}"
        )
    if cfg.rollout.engine.speculative == "mtp" and cfg.model.mtp_layers == 0:
        raise ConfigError("rollout.engine.speculative: 'mtp' drafts with the MTP modules; set model.mtp_layers > 0")
    if cfg.trainer.mtp_lr is not None and cfg.model.mtp_layers == 0:
        raise ConfigError("trainer.mtp_lr: the MTP modules' lr; set model.mtp_layers > 0 or leave it null")
    _check_task(cfg.task, cfg.base_dir)
    _check_progress(cfg)
    p = cfg.policy
    budget = window_budget(cfg.batch_size, p.require_batches, p.trigger_parameter_sync_step,
                           p.staleness_threshold)
    if cfg.transfer_queue.capacity < budget:
        raise ConfigError(
            f"transfer_queue.capacity: {cfg.transfer_queue.capacity} is below the admission window "
            f"of {budget} samples (policy.staleness_threshold etc.); raise it to at least {budget}")
    try:
        cfg.sync.in_flight_for(cfg.rollout.engine.type)
    except ValueError as err:
        raise ConfigError(f"sync.in_flight: {err}") from None
    if cfg.sync.transport not in ("auto", "inproc") and cfg.runtime.type == "local":
        raise ConfigError(f"sync.transport: {cfg.sync.transport!r} needs one process per actor "
                          "(runtime.type=process or ray)")
    if cfg.sync.transport == "inproc" and cfg.runtime.type != "local":
        raise ConfigError("sync.transport: 'inproc' needs the trainer and the engines in one process "
                          "(runtime.type=local); leave it 'auto' to pick by placement")
    if cfg.sync.transport == "ray" and cfg.runtime.type != "ray":
        raise ConfigError("sync.transport: 'ray' (Ray's object store) needs runtime.type=ray")
    if cfg.sync.transport == "cuda_ipc" and not all(
            d.startswith("cuda") for d in (cfg.trainer.device, cfg.rollout.engine.device)):
        raise ConfigError(f"sync.transport: 'cuda_ipc' needs the trainer and the engines on GPUs; got "
                          f"trainer.device={cfg.trainer.device!r}, rollout.engine.device={cfg.rollout.engine.device!r}")
    if cfg.transfer_queue.deployment == "ray" and cfg.runtime.type != "ray":
        raise ConfigError("transfer_queue.deployment: 'ray' needs runtime.type=ray")
    if cfg.runtime.placement != PlacementConfig() and cfg.runtime.type != "ray":
        raise ConfigError("runtime.placement: only used with runtime.type=ray")
    if cfg.runtime.address is not None and cfg.runtime.type != "ray":
        raise ConfigError("runtime.address: only used with runtime.type=ray")
    if cfg.runtime.mps:
        if cfg.runtime.type != "process":
            raise ConfigError(f"runtime.mps: needs runtime.type=process (got {cfg.runtime.type!r}: under local "
                              "one process holds one CUDA context; on Ray, run MPS on each node yourself)")
        if not any(d.startswith("cuda") for d in (cfg.trainer.device, cfg.rollout.engine.device)):
            raise ConfigError("runtime.mps: no actor is on a GPU (trainer.device and rollout.engine.device "
                              "are not cuda)")
        if (reason := mps_unavailable()) is not None:
            raise ConfigError(f"runtime.mps: {reason}")
    elif cfg.runtime.mps_trainer_sm_percent is not None:
        raise ConfigError("runtime.mps_trainer_sm_percent: needs runtime.mps=true")
    if cfg.runtime.address is not None and not (
            (m := _RAY_ADDRESS.fullmatch(cfg.runtime.address)) and 0 < int(m["port"] or 1) < 65536):
        raise ConfigError(f"runtime.address: expected auto, host:port or ray://host:port (the head's address), got "
                          f"{cfg.runtime.address!r}; leave it unset to start a cluster for the run")
    ports = cfg.transfer_queue.ports
    if ports is not None and (cfg.transfer_queue.deployment != "ray" or ports[0] > ports[1]):
        raise ConfigError(f"transfer_queue.ports: expected [first, last] with first <= last, used with "
                          f"transfer_queue.deployment=ray; got {list(ports)} with {cfg.transfer_queue.deployment!r}")
    n = cfg.trainer.num_workers
    if n > 1 and cfg.runtime.type == "local":
        raise ConfigError(f"trainer.num_workers: {n} trainer workers need one process each "
                          "(runtime.type=process or ray)")
    if cfg.trainer.batch_prompts % n:
        raise ConfigError(f"trainer.batch_prompts: {cfg.trainer.batch_prompts} is not a multiple of "
                          f"trainer.num_workers={n} (each worker trains whole groups)")
    if not math.isfinite(cfg.trainer.lr):
        raise ConfigError(f"trainer.lr: expected a finite float, got {cfg.trainer.lr}")


def config_warnings(cfg: Config) -> list[str]:
    """Settings that load but were measured to hurt a run: one line each, which the run logs
    as a warning when it starts (``actors.run.Run``)."""
    warnings = []
    if cfg.rollout.engine.weight_dtype == "fp8" and cfg.trainer.loss == "ppo_clip":
        warnings.append("rollout.engine.weight_dtype: fp8 with trainer.loss: ppo_clip clips against the FP8 "
                        "engine's log-probs; on SmolLM2-135M 5 of 5 seeds learned less, then collapsed within "
                        "100 steps; with trainer.loss: decoupled_ppo 5 of 5 learned, to 0.71 held-out reward "
                        "against bf16's 0.74 (docs/fp8.md)")
    return warnings


def checkpoint_every(cfg: Config) -> int:
    """Steps between run checkpoints (0 = none)."""
    return cfg.run.checkpoint_every


def _moved(tree: dict[str, object], resumed: bool) -> dict[str, object]:
    """``trainer.checkpoint_every``, the older name of ``run.checkpoint_every``:
    one line naming the new key in a config; folded into it in the config a
    run saved before the rename, so that run still resumes."""
    trainer = tree.get("trainer")
    if not isinstance(trainer, dict) or "checkpoint_every" not in trainer:
        return tree
    if not resumed:
        raise ConfigError("trainer.checkpoint_every: renamed run.checkpoint_every (it writes the run checkpoint)")
    tree, trainer = dict(tree), dict(trainer)
    every = trainer.pop("checkpoint_every")
    tree["trainer"] = trainer
    if every:
        tree["run"] = {**tree.get("run", {}), "checkpoint_every": tree.get("run", {}).get("checkpoint_every") or every}
    return tree


def _check_task(task: TaskConfig, base_dir: str) -> None:
    """The task exists and takes ``task.kwargs`` (by its signature: nothing is built);
    a user reward function (``task.kwargs.reward``) is imported and its form read
    from its signature, a relative ``file.py`` anchored as data files are."""
    try:
        factory = task_factory(task.type)
    except ValueError as err:
        raise ConfigError(f"task.type: {err}") from None
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: its options are checked when it is built
        return
    context = {k: None for k in CONTEXT_OPTIONS if k in signature.parameters}  # make_task passes these
    try:
        signature.bind(**task.kwargs, **context)
    except TypeError as err:
        raise ConfigError(f"task.kwargs: bad options for task {task.type!r}: {err}") from None
    reward = task.kwargs.get("reward")
    if isinstance(reward, str) and "reward" in signature.parameters and "<" not in reward.rpartition(":")[2]:
        # (a nested function's "<locals>" name: recorded by launch(reward=fn), which passes it again to resume)
        task.kwargs["reward"] = reward = anchor_reward_spec(reward, base_dir)  # actors may run elsewhere
        try:
            reward_form(reward)  # a function no form fits is refused now, not at its first sample
        except ValueError as err:
            raise ConfigError(f"task.kwargs.reward: {err}") from None


def _check_progress(cfg: Config) -> None:
    """Refuse the schedules that cannot train as configured (each was tried: the
    fully-async one waits forever; one-step-off drops every batch it generates ahead)."""
    p = cfg.policy
    k, ms = p.trigger_parameter_sync_step, p.max_staleness
    if p.type == "fully_async" and ms < k - 1:
        # step j of a sync window trains at version v + j - 1 on samples the engines made at v
        raise ConfigError(
            f"policy.max_staleness: {ms} is below policy.trigger_parameter_sync_step - 1 = {k - 1}: the engines keep "
            f"one version for the {k} trainer steps between syncs, so step {ms + 2} of each window finds every sample "
            f"{ms + 1} version{'s' if ms else ''} old, drops it and waits for a sync that only comes after that step; set "
            f"policy.max_staleness >= {k - 1} or policy.trigger_parameter_sync_step <= {ms + 1}")
    if p.type == "one_step_off" and ms < 1:
        raise ConfigError(
            "policy.max_staleness: 0 with policy.type=one_step_off: that schedule trains each batch it generates "
            "ahead one version after the weights that made it, so every such batch is dropped as stale; set "
            "policy.max_staleness >= 1, or policy.type=sync to train on-policy")


def build_config(tree: dict[str, object], base_dir: str = ".", check: bool = True) -> Config:
    """Decode a raw tree into a :class:`Config` or raise :class:`ConfigError`; ``check``: its
    sections against each other and against this machine (what it can build) too."""
    if not isinstance(tree, dict):
        raise ConfigError(f"<root>: expected a mapping of sections, got {type(tree).__name__}")
    tree = dict(tree)
    if "base_dir" in tree:
        raise ConfigError("base_dir: set by the loader, not by the config file")
    tree["base_dir"] = base_dir
    try:
        cfg = msgspec.convert(tree, Config, strict=False)
    except msgspec.ValidationError as err:
        raise ConfigError(friendly(err, Config, tree)) from None
    if check:
        _check_consistency(cfg)
    return cfg


def load_config(path: str | pathlib.Path | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config file (or only defaults when ``path`` is None), apply overrides."""
    tree: Any = {}
    base_dir = "."
    if path is not None:
        p = pathlib.Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        tree = read_yaml(p)
        base_dir = str(p.resolve().parent)
    tree = apply_overrides(tree, list(overrides))
    return build_config(_moved(tree, resumed=False), base_dir)


# What a resumed run may change: how long it runs, how it reports and checkpoints,
# where its actors are placed, and how the trainer runs the same math (the kernels
# and graphs ``auto`` chose on the first machine may be missing on the next).
# Everything else is what the checkpoint was made of (model, task, batch shape,
# dtypes, schedule, queue, sync): changing it would resume a different run.
RESUMABLE_KEYS = ("run.total_steps", "run.progress", "run.watchdog_s", "run.stop_grace_s", "run.checkpoint_every",
                  "run.keep_checkpoints", "run.save_final", "run.log_samples_every", "run.log_samples", "run.loggers",
                  "run.wandb_project", "run.wandb_mode",
                  "runtime.type", "runtime.address", "runtime.num_cpus", "runtime.connect_timeout_s", "runtime.mps",
                  "runtime.mps_trainer_sm_percent",
                  "rollout.max_respawns", "trainer.kernels", "trainer.cuda_graphs")


def _saved_tree(p: pathlib.Path) -> tuple[dict[str, object], str]:
    """A resolved config a run saved (``config.yaml``): its tree and ``base_dir``."""
    tree = _moved(read_yaml(p), resumed=True)
    base_dir = tree.pop("base_dir", None)
    if not isinstance(base_dir, str):
        raise ConfigError(f"{p}: not a resolved run config (no base_dir)")
    return tree, base_dir


def load_saved_config(saved: str | pathlib.Path, overrides: list[str] = ()) -> Config:
    """The resolved config a run saved (``config.yaml``), with any ``overrides``
    (``actors.evaluate``: another model path, held-out data)."""
    tree, base_dir = _saved_tree(pathlib.Path(saved))
    return build_config(apply_overrides(tree, list(overrides)), base_dir)


def load_resume_config(saved: str | pathlib.Path, overrides: list[str] = ()) -> Config:
    """The resolved config a checkpoint saved (``config.yaml``), with overrides of
    :data:`RESUMABLE_KEYS` only; any other key is a :class:`ConfigError` naming it."""
    tree, base_dir = _saved_tree(pathlib.Path(saved))
    before = build_config(dict(tree), base_dir, check=False)  # as saved: this machine may lack what it used
    cfg = build_config(apply_overrides(tree, list(overrides)), base_dir)
    changed = [key for key in _diff(msgspec.to_builtins(before), msgspec.to_builtins(cfg))
               if key not in RESUMABLE_KEYS and not key.startswith("runtime.placement.")]
    if changed:
        raise ConfigError(f"{changed[0]}: cannot change when resuming (the checkpoint was made with another value); "
                          f"a resumed run may change only {', '.join(RESUMABLE_KEYS)}")
    return cfg


def _diff(a: object, b: object, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config trees."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in sorted(set(a) | set(b))
                for k in _diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)]
    return [] if a == b else [prefix]


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (saved with every run)."""
    tree = msgspec.to_builtins(cfg)
    return yaml.safe_dump(tree, sort_keys=False)
