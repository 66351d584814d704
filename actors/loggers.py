"""Where a run's metrics go: ``run.loggers``, a list of ``jsonl`` (always),
``tensorboard`` and ``wandb``.

    Run ── one JSON line a record ──► MetricsLog.write ──► metrics.jsonl   (the run's own record)
                                                      └──► each mirror.log(step, scalars, texts)
                                                             tensorboard: <run dir>/tensorboard/ event files
                                                             wandb:       <run dir>/wandb/<offline-run-...>/

The mirrors get exactly the records ``metrics.jsonl`` holds (each line parsed
back as it is written), so every logger shows the same metric names and values
at the same step: the record's own ``step`` (0 for the held-out evaluation before
the first step). :func:`flatten` says how a record's values map onto a scalar
logger's. ``metrics.jsonl`` cannot be left out: resume cuts it back to a
checkpoint and ``Run.summary`` reads it.

The resolved config is logged once per process as hyperparameters: TensorBoard's
HParams (config keys dotted, ``trainer.lr``) and the YAML as text under
``config``; W&B's run config (nested, as in ``config.yaml``).

W&B runs ``offline`` by default (``run.wandb_mode``): nothing leaves the machine
and no login is asked for; ``wandb sync <run dir>/wandb/offline-run-*`` uploads it
later. Its run id is the run directory's name, so a resumed run continues the
same W&B run (a new ``offline-run-*`` directory of the same id; records of steps
the resume rolled back are logged again).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Protocol

from actors.backends.config import import_error
from contracts.sample import Sample

__all__ = ["LOGGER_TYPES", "MetricsLog", "flatten", "loggers_unavailable", "open_metrics_log", "sample_rows"]

LOGGER_TYPES = ("jsonl", "tensorboard", "wandb")
#: The package each optional logger needs (the extra of the same name installs it).
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def loggers_unavailable(names: tuple[str, ...] | list[str]) -> str | None:
    """Why the list ``names`` (``run.loggers``) cannot be used here, as the tail
    of an error about that key; None when it can. Optional packages are imported
    (only those named) so a broken install is caught at config load."""
    if "jsonl" not in names:
        return (f"{list(names)} lacks 'jsonl': metrics.jsonl is the run's own record (resume and the "
                f"summary read it); list it with the others, e.g. [jsonl, {', '.join(names) or 'tensorboard'}]")
    seen = [n for i, n in enumerate(names) if n in names[:i]]
    if seen:
        return f"{seen[0]!r} is listed twice"
    for name in names:
        if name not in LOGGER_TYPES:  # the config's type already refuses these; direct callers too
            return f"{name!r} is unknown (expected any of: {', '.join(LOGGER_TYPES)})"
        package = _PACKAGES.get(name)
        why = None if package is None else import_error(package)
        if why is not None:
            return (f"{name!r} needs the {package} package, which {why}; install the optional extra: "
                    f"pip install -e \".[{name}]\"")
    return None


def flatten(record: dict[str, object]) -> tuple[int, dict[str, int | float], dict[str, str]]:
    """A metrics record as ``(step, scalars, texts)`` under the record's own keys.

    Numbers are scalars as they are, ``True``/``False`` as 1/0; a nested mapping
    is flattened with ``/`` (``dropped: {stale: 3}`` -> ``dropped/stale``); a
    string (``sync/kind``, ``resumed_from``) is a text; a list is a text of its
    JSON; ``None`` is left out. ``step`` is the step, not a metric."""
    scalars: dict[str, int | float] = {}
    texts: dict[str, str] = {}

    def visit(key: str, value: object) -> None:
        if isinstance(value, bool):
            scalars[key] = int(value)
        elif isinstance(value, (int, float)):
            scalars[key] = value
        elif isinstance(value, str):
            texts[key] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{key}/{k}", v)
        elif value is not None:
            texts[key] = json.dumps(value)

    for key, value in record.items():
        if key != "step":
            visit(key, value)
    return int(record["step"]), scalars, texts


def sample_rows(step: int, samples: list[Sample], tokenizer: object) -> list[dict[str, object]]:
    """``samples.jsonl`` rows of a step's samples: prompt and completion as text
    (special tokens kept, so a missing stop shows) when ``tokenizer`` decodes, else
    as token ids; reward, finish reason, completion length and the weight versions."""
    decode = getattr(tokenizer, "decode", None)

    def text(ids: list[int]) -> str | list[int]:
        try:
            return decode(list(ids)) if decode is not None else list(ids)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode these ids: show the ids
            return list(ids)

    return [{"step": step, "prompt": text(s.prompt_ids), "completion": text(s.response_ids), "reward": s.reward,
             "finish_reason": s.finish_reason, "num_tokens": len(s.response_ids),
             "versions": [s.min_version, s.max_version]} for s in samples]


def _samples_markdown(rows: list[dict[str, object]]) -> str:
    """A step's sample rows as one TensorBoard text (markdown)."""
    return "\n\n".join(f"**reward {r['reward']}** ({r['finish_reason']}, {r['num_tokens']} tokens)\n\n"
                        f"```\n{r['prompt']}\n--- completion ---\n{r['completion']}\n```" for r in rows)


class _Mirror(Protocol):
    """A logger beside metrics.jsonl: gets every record, flattened."""

    def log(self, step: int, scalars: dict[str, int | float], texts: dict[str, str]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _hparam(value: object) -> int | float | str | bool:
    """A config value as TensorBoard's HParams takes it (scalars; anything else as text)."""
    return value if isinstance(value, (int, float, str, bool)) else json.dumps(value)


def _dotted(tree: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_dotted(value, name + "."))
        else:
            out[name] = value
    return out


class TensorBoardMirror:
    """Event files under ``log_dir``: scalars as float32 ``simple_value`` (what
    ``tensorboard --logdir`` shows: its default fast loader drops the float64
    tensor form; values round to float32, ~7 significant digits, metrics.jsonl
    keeps them exact), texts with TensorBoard's text plugin. ``purge_step``: a
    resumed run's first step; TensorBoard hides what an earlier process logged
    from there on (the steps the resume rolled back)."""

    def __init__(self, log_dir: pathlib.Path, config: dict[str, object], config_yaml: str, *,
                 purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step, flush_secs=10)
        params = {k: _hparam(v) for k, v in _dotted(config).items()}
        for summary in hparams(params, {"reward": 0.0, "eval/reward": 0.0}):
            self.writer._get_file_writer().add_summary(summary)
        self.writer.add_text("config", "```yaml\n" + config_yaml + "```", global_step=purge_step or 0)

    def log(self, step: int, scalars: dict[str, int | float], texts: dict[str, str]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        for key, value in texts.items():
            self.writer.add_text(key, value, global_step=step)

    def log_samples(self, step: int, rows: list[dict[str, object]]) -> None:
        self.writer.add_text("samples", _samples_markdown(rows), global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbMirror:
    """A W&B run in ``run_dir/wandb`` (``mode`` offline: no network, no login),
    its id the run directory's name, the resolved config as its config."""

    def __init__(self, run_dir: pathlib.Path, config: dict[str, object], *, project: str, mode: str) -> None:
        import wandb

        run_id = re.sub(r"[^A-Za-z0-9_.-]", "-", run_dir.name)[-128:]
        settings = wandb.Settings(silent=True, console="off", disable_git=True, x_disable_stats=True,
                                  reinit="create_new")  # another Run in this process gets its own W&B run
        self.run = wandb.init(project=project, dir=str(run_dir), mode=mode, id=run_id, name=run_dir.name,
                              resume="allow", config=config, settings=settings)

    def log(self, step: int, scalars: dict[str, int | float], texts: dict[str, str]) -> None:
        self.run.log({**scalars, **texts}, step=step)

    def flush(self) -> None:
        pass  # the W&B service writes as it receives

    def close(self) -> None:
        self.run.finish()


class MetricsLog:
    """``metrics.jsonl`` opened for appending, and its mirrors behind one
    file-like face: ``write`` takes whole JSON lines (one record each) and hands
    every record to each mirror as well; ``tell`` is the file's (a checkpoint
    records how far it got); ``flush`` and ``close`` reach the mirrors too."""

    def __init__(self, path: pathlib.Path, mirrors: list[_Mirror]) -> None:
        self._file = open(path, "a", buffering=1)
        self._mirrors = mirrors
        self._partial = ""  # a line not yet ended (write is called with whole lines)
        self._samples_path = path.with_name("samples.jsonl")

    def write_samples(self, rows: list[dict[str, object]]) -> None:
        """Append a step's sample rows (:func:`sample_rows`) to ``samples.jsonl``, and
        show them in TensorBoard as text (a W&B step is logged once: not there)."""
        if not rows:
            return
        with open(self._samples_path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        for mirror in self._mirrors:
            if isinstance(mirror, TensorBoardMirror):
                mirror.log_samples(rows[0]["step"], rows)

    def write(self, text: str) -> int:
        n = self._file.write(text)
        if self._mirrors:
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                if line.strip():
                    step, scalars, texts = flatten(json.loads(line))
                    for mirror in self._mirrors:
                        mirror.log(step, scalars, texts)
        return n

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()
        for mirror in self._mirrors:
            mirror.flush()

    def close(self) -> None:
        """Close the file and every mirror (each is closed even when one fails; the first error is raised)."""
        errors: list[BaseException] = []
        for close in [self._file.close, *(m.close for m in self._mirrors)]:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - the others still close; the first is re-raised below
                errors.append(e)
        self._mirrors = []
        if errors:
            raise errors[0]


def open_metrics_log(run_dir: pathlib.Path, run_cfg: Any, *, resume_step: int | None = None) -> MetricsLog:
    """``run_dir/metrics.jsonl`` with the mirrors ``run_cfg.loggers`` names (the
    ``run`` section; :func:`loggers_unavailable` checked it at load), each given
    the resolved config the run saved (``run_dir/config.yaml``) as hyperparameters.
    ``resume_step``: the checkpoint's step when the run resumed from one."""
    import yaml

    mirrors: list[_Mirror] = []
    if set(run_cfg.loggers) - {"jsonl"}:
        config_yaml = (run_dir / "config.yaml").read_text()
        config = yaml.safe_load(config_yaml)
    try:
        if "tensorboard" in run_cfg.loggers:
            mirrors.append(TensorBoardMirror(run_dir / "tensorboard", config, config_yaml,
                                             purge_step=None if resume_step is None else resume_step + 1))
        if "wandb" in run_cfg.loggers:
            mirrors.append(WandbMirror(run_dir, config, project=run_cfg.wandb_project, mode=run_cfg.wandb_mode))
    except BaseException:
        for mirror in mirrors:
            mirror.close()
        raise
    return MetricsLog(run_dir / "metrics.jsonl", mirrors)
