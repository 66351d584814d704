"""Typed run configuration: ``fully_async.yaml`` decoded into msgspec Structs.

Every field is documented where it is declared and bounded where a bound
exists. Unknown keys, wrong types and out-of-range values are
:class:`ConfigError` naming the dotted path (``trainer.lr: expected float,
got str``). After :func:`load_config` no raw dict survives.
"""

from __future__ import annotations

import math
import pathlib
import re
import typing
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

__all__ = ["Config", "ConfigError", "load_config", "apply_overrides", "to_yaml"]

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=1, le=65535)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Prob = Annotated[float, Meta(ge=0, le=1)]


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key."""


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


class RuntimeConfig(_Section):
    type: Literal["local", "process", "ray"] = "local"
    """``local``: actors live in this process, each with one worker thread.
    ``process``: each actor in a child process of its own (no Ray needed; the
    actors' Python no longer shares one GIL). ``ray``: each actor is a Ray actor."""
    address: str | None = None
    """Ray only. ``auto`` joins a running cluster (never shut down by us);
    ``None`` starts a local cluster for the run and stops it at the end."""
    num_cpus: PosInt | None = None
    """Ray only, for a cluster we start: logical CPUs to give it (default: the
    machine's cores, at least one per actor)."""


class ModelConfig(_Section):
    path: str = "actors/assets/tiny-qwen2"
    """A Hugging Face causal-LM directory (config.json, safetensors, tokenizer).
    Relative paths resolve against the config file's directory."""


class TaskConfig(_Section):
    type: str = "reverse_digits"
    """Built-in task name (see ``policies.tasks``)."""
    kwargs: dict[str, int | float | str | bool] = msgspec.field(default_factory=dict)
    """Task-specific options (e.g. digit counts or a length distribution)."""


class EngineConfig(_Section):
    type: Literal["torch", "vllm", "sglang"] = "torch"
    """Rollout engine. ``torch`` is built in."""
    device: str = "cpu"
    """``cpu`` or ``cuda[:i]``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and compute dtype of the engine (fp32 on CPU)."""
    max_num_seqs: PosInt = 128
    """Concurrent sequences the engine batches."""
    max_model_len: PosInt = 128
    """Prompt + response tokens per sequence (KV cache slot length)."""
    cuda_graphs: bool = True
    """Built-in engine on CUDA: replay decode steps as CUDA graphs."""
    compile_decode: bool = False
    """Built-in engine on CUDA, decode batches over 64 rows: fuse their elementwise work
    with torch.compile (compiles once per batch-size bucket: pays off in long runs).
    Batches of up to 64 rows run the fused Triton decode layers where those apply
    (Triton installed; Llama / Qwen2, not Qwen3's q/k norms)."""


class RolloutConfig(_Section):
    num_actors: PosInt = 1
    """Rollout actors, each with its own engine."""
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    n: PosInt = 8
    """Samples per prompt (GRPO group size)."""
    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: NonNegInt = 0
    """0 = off."""
    max_response_tokens: PosInt = 16
    """Total new-token budget of a response, across every resume."""
    partial_rollout: bool = True
    """Keep and resume generations interrupted by a weight sync (else drop them, counted)."""


class TrainerConfig(_Section):
    backend: Literal["torch", "megatron"] = "torch"
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    master_dtype: Literal["float32", "bfloat16"] | None = "float32"
    """Dtype of the optimizer's main params when ``dtype`` is lower (fp32 main params,
    Megatron-style: AdamW steps them, the model keeps ``dtype`` copies, which the weight
    sync reads). ``null``: step the model params in ``dtype`` as they are."""
    lr: PosFloat = 1e-5
    """AdamW learning rate."""
    weight_decay: NonNegFloat = 0.0
    grad_clip: PosFloat = 1.0
    """Max global grad norm."""
    batch_prompts: PosInt = 16
    """Prompts (whole groups) per trainer step; batch size = batch_prompts * rollout.n."""
    loss: Literal["ppo_clip", "decoupled_ppo", "tis_token", "tis_seq"] = "ppo_clip"
    """Policy loss and off-policy correction (see ``policies.losses``)."""
    clip_eps: PosFloat = 0.2
    """PPO clip range (both sides)."""
    is_cap: PosFloat = 2.0
    """Cap of truncated importance weights (tis_* and decoupled_ppo)."""
    micro_batch_tokens: NonNegInt = 2048
    """Padded tokens per forward pass (rows sorted by length, gradients
    accumulated): long-tailed batches stop padding every row to the longest.
    0 = the whole batch in one pass."""
    checkpoint_every: NonNegInt = 0
    """Save a checkpoint (safetensors + optimizer) into the run directory every
    this many steps (0 = never; ``Run.save_checkpoint()`` saves on demand)."""


class PolicyConfig(_Section):
    type: Literal["fully_async", "sync", "one_step_off"] = "fully_async"
    """Schedule: fully-async, synchronous on-policy, or one-step-off baseline."""
    staleness_threshold: NonNegFloat = 1.0
    """Extra samples admitted per sync window, as a fraction of the window's
    training need (0 = generate only what the next sync window trains on)."""
    require_batches: PosInt = 1
    """Batches the trainer takes per step."""
    trigger_parameter_sync_step: PosInt = 1
    """Trainer steps between weight syncs."""
    max_staleness: NonNegInt = 2
    """Trainer-side bound: drop samples whose oldest token is more than this many versions old."""
    reward_timeout_s: PosFloat = 30.0
    """A reward call slower than this counts as an error for its sample."""
    overlap_push: bool | None = None
    """Fully-async: the trainer takes its next step while a weight push is
    applied (it waits only for the encode). ``null`` (auto): true when the
    trainer's device is none of the engines' (the push then costs the trainer
    nothing), false when they share one, where the push would compete with the
    train step for that device (measured on one H200: bench/results/async_vs_sync_h200_process*.json)."""


class QueueConfig(_Section):
    capacity: PosInt = 4096
    """Samples the TransferQueue holds before ``put`` waits."""
    num_storage_units: PosInt = 2
    lease_s: PosFloat = 600.0
    """A batch not acknowledged within this returns to the ready set."""
    deployment: Literal["local", "ray"] = "local"
    """``local``: controller and storage units in the driver process. ``ray``:
    they are Ray actors (needs ``runtime.type=ray``)."""
    ports: tuple[Port, Port] | None = None
    """``ray`` only: the TCP ports [first, last] its actors listen on (each
    takes the first free one on its node); null: any free port."""


class SyncConfig(_Section):
    mode: Literal["full", "delta", "auto"] = "delta"
    """Weight push encoding after the first full push."""
    full_every_k: NonNegInt = 0
    """Force a full push every K versions (0 = never)."""
    bucket_bytes: PosInt = 64 << 20
    """Payload bucket size: bounds the extra memory of a push."""
    colocated: bool = True
    """Trainer and engine share a device: free the KV cache during a push."""
    transport: Literal["inproc", "broadcast", "cuda_ipc"] = "inproc"
    """How the payload moves: ``inproc`` through the driver (any runtime);
    ``broadcast``: torch.distributed from the trainer's process to every
    rollout actor's (gloo on CPU, NCCL on GPU); ``cuda_ipc``: the payload
    stays in the trainer's GPU memory and each engine maps it (trainer and
    engines on GPUs of one host). Both need one process per actor:
    ``runtime.type`` ``process`` or ``ray``."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """torch.distributed backend of ``transport=broadcast``."""


class Config(_Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    transfer_queue: QueueConfig = msgspec.field(default_factory=QueueConfig)
    sync: SyncConfig = msgspec.field(default_factory=SyncConfig)
    base_dir: str = "."
    """Directory of the config file (relative paths resolve against it); set by the loader."""

    @property
    def batch_size(self) -> int:
        return self.trainer.batch_prompts * self.rollout.n


# --- YAML ------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``2e-6`` as a float (YAML 1.2), not a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader) if text.strip() else ""
    except yaml.YAMLError:
        return text


_MSG = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _friendly(err: msgspec.ValidationError) -> str:
    m = _MSG.match(str(err))
    what, path = m.group("what"), (m.group("path") or "").lstrip(".")
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    unknown = re.match(r"Object contains unknown field `(.+)`", what)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return f"{key}: unknown key{_known_keys(path)}"
    missing = re.match(r"Object missing required field `(.+)`", what)
    if missing:
        key = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return f"{key}: required key is missing"
    if what.startswith("Invalid enum value"):
        allowed = _choices(_field_type(path))
        if allowed:
            what += f" (expected one of: {', '.join(allowed)})"
    what = re.sub(r"`([^`]*)`", r"\1", what)
    what = what[0].lower() + what[1:] if what else what
    return f"{path or '<root>'}: {what}"


def _choices(tp: Any) -> list[str]:
    """The values a Literal field takes, ``null`` for an optional one (``Literal[...] | None``)."""
    if typing.get_origin(tp) is typing.Literal:
        return [str(a) for a in typing.get_args(tp)]
    return [c for a in typing.get_args(tp) for c in (["null"] if a is type(None) else _choices(a))]


def _field_type(path: str) -> Any:
    node: Any = Config
    for part in [p for p in path.split(".") if p]:
        if not (isinstance(node, type) and issubclass(node, msgspec.Struct)):
            return None
        fields = {f.name: f for f in msgspec.structs.fields(node)}
        if part not in fields:
            return None
        node = fields[part].type
    return node


def _known_keys(path: str) -> str:
    node = _field_type(path)
    if isinstance(node, type) and issubclass(node, msgspec.Struct):
        names = [f.name for f in msgspec.structs.fields(node) if f.name != "base_dir"]
        return f" (expected one of: {', '.join(names)})"
    return ""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
            raise ConfigError(f"override {item!r}: expected key.path=value")
        _set_dotted(tree, key, _parse_scalar(raw))
    return tree


def _check_consistency(cfg: Config) -> None:
    if cfg.rollout.max_response_tokens >= cfg.rollout.engine.max_model_len:
        raise ConfigError(
            f"rollout.max_response_tokens: {cfg.rollout.max_response_tokens} leaves no room for "
            f"the prompt in rollout.engine.max_model_len={cfg.rollout.engine.max_model_len}"
        )
    from policies.admission import window_budget

    p = cfg.policy
    budget = window_budget(cfg.batch_size, p.require_batches, p.trigger_parameter_sync_step,
                           p.staleness_threshold)
    if cfg.transfer_queue.capacity < budget:
        raise ConfigError(
            f"transfer_queue.capacity: {cfg.transfer_queue.capacity} is below the admission window "
            f"of {budget} samples (policy.staleness_threshold etc.); raise it to at least {budget}")
    if cfg.sync.transport != "inproc" and cfg.runtime.type == "local":
        raise ConfigError(f"sync.transport: {cfg.sync.transport!r} needs one process per actor "
                          "(runtime.type=process or ray)")
    if cfg.sync.transport == "cuda_ipc" and not all(
            d.startswith("cuda") for d in (cfg.trainer.device, cfg.rollout.engine.device)):
        raise ConfigError(f"sync.transport: 'cuda_ipc' needs the trainer and the engines on GPUs; got "
                          f"trainer.device={cfg.trainer.device!r}, rollout.engine.device={cfg.rollout.engine.device!r}")
    if cfg.transfer_queue.deployment == "ray" and cfg.runtime.type != "ray":
        raise ConfigError("transfer_queue.deployment: 'ray' needs runtime.type=ray")
    if cfg.runtime.address is not None and cfg.runtime.type != "ray":
        raise ConfigError("runtime.address: only used with runtime.type=ray")
    ports = cfg.transfer_queue.ports
    if ports is not None and (cfg.transfer_queue.deployment != "ray" or ports[0] > ports[1]):
        raise ConfigError(f"transfer_queue.ports: expected [first, last] with first <= last, used with "
                          f"transfer_queue.deployment=ray; got {list(ports)} with {cfg.transfer_queue.deployment!r}")
    if not math.isfinite(cfg.trainer.lr):
        raise ConfigError(f"trainer.lr: expected a finite float, got {cfg.trainer.lr}")


def build_config(tree: dict[str, Any], base_dir: str = ".") -> Config:
    """Decode a raw tree into a :class:`Config` or raise :class:`ConfigError`."""
    if not isinstance(tree, dict):
        raise ConfigError(f"<root>: expected a mapping of sections, got {type(tree).__name__}")
    tree = dict(tree)
    if "base_dir" in tree:
        raise ConfigError("base_dir: set by the loader, not by the config file")
    tree["base_dir"] = base_dir
    try:
        cfg = msgspec.convert(tree, Config, strict=False)
    except msgspec.ValidationError as err:
        raise ConfigError(_friendly(err)) from None
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
        try:
            tree = yaml.load(p.read_text(), Loader=_Loader) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{p}: malformed YAML{where}: {problem}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: expected a mapping of sections at the top level")
        base_dir = str(p.resolve().parent)
    tree = apply_overrides(tree, list(overrides))
    return build_config(tree, base_dir)


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (saved with every run)."""
    tree = msgspec.to_builtins(cfg)
    return yaml.safe_dump(tree, sort_keys=False)
