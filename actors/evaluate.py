"""Score a trained model on held-out prompts with its task's reward: one JSON line.

    python -m actors.evaluate runs/<dir>                   # the run's newest checkpoint (its final one)
    python -m actors.evaluate exported/ [CONFIG] [key.path=value ...]
    python -m actors.evaluate runs/<dir> task.kwargs.eval_path=held_out.jsonl policy.eval_prompts=200

    {"reward": 0.41, "num_prompts": 32, "num_errors": 0, "response_len_mean": 5.2, "eval_s": 1.3,
     "model": "...", "task": "reverse_digits", "step": 500}

It is the evaluation a run does every ``policy.eval_every`` steps, with no
training: a run is set up from a config whose ``model.path`` is the model to
score (in a scratch directory, removed after), its rollout actors give one
greedy response to each of the task's first ``policy.eval_prompts`` held-out
prompts (``task.kwargs.eval_path`` for ``text_dataset``), and ``reward`` is their
mean reward (``policies.base.PolicyBase.evaluate``).

The config: a run directory's own (its checkpoint's weights are exported to the
scratch directory first); for a model directory, ``CONFIG`` when given, else the
config of the run it was exported from (``export.json``), else the defaults.
Overrides apply to it either way (any key: this is no resume).

Part of the composition root: nothing but tools and tests imports it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import traceback

import loop
from actors import checkpoint
from actors.config import Config, load_config, load_saved_config

__all__ = ["evaluate", "main"]

# a run for scoring only: no progress bar, no checkpoints, no evaluation of its own
_SCORING = ["run.progress=false", "run.checkpoint_every=0", "run.save_final=false", "run.log_samples_every=0",
            "policy.eval_every=0"]


def _config(target: pathlib.Path, config: str | None, overrides: list[str], scratch: pathlib.Path,
            ) -> tuple[Config, dict[str, object]]:
    """The config to score ``target`` with (its ``model.path`` the model to score), and what
    the output line says about where the weights came from."""
    overrides = [*overrides, *_SCORING, f"run.output_dir={scratch / 'runs'}"]
    if not (target / "config.json").is_file():  # a run directory (or one of its checkpoints)
        if config is not None:
            raise ValueError(f"{str(target)!r} is a run directory: it is scored with its own config, not {config!r}")
        from actors.export import export_checkpoint

        ckpt, _ = checkpoint.find(target)
        model = export_checkpoint(ckpt, scratch / "model")
        cfg = load_saved_config(ckpt / "config.yaml", [*overrides, f"model.path={model}"])
        return cfg, {"model": str(ckpt), "step": checkpoint.read_state(ckpt)["step"]}
    overrides.append(f"model.path={target}")
    source = target / "export.json"
    run_config = None
    if config is None and source.is_file():  # exported from a run: that run's task
        run_dir = json.loads(source.read_text()).get("run_dir")
        run_config = pathlib.Path(run_dir) / "config.yaml" if run_dir else None
    if run_config is not None and run_config.is_file():
        return load_saved_config(run_config, overrides), {"model": str(target)}
    return load_config(config, overrides), {"model": str(target)}


def evaluate(target: str | pathlib.Path, config: str | None = None, overrides: list[str] = ()) -> dict[str, object]:
    """Score ``target`` (a run directory, one of its checkpoints, or a model directory):
    the mean reward of one greedy response to each held-out prompt, with counts."""
    from actors.run import Run

    target = pathlib.Path(target).expanduser().absolute()
    if not target.is_dir():
        raise ValueError(f"{str(target)!r} is not a directory (a run directory or a model directory)")
    with tempfile.TemporaryDirectory(prefix="asyncrl-evaluate-") as tmp:
        cfg, where = _config(target, config, list(overrides), pathlib.Path(tmp))
        with Run(cfg) as run:
            scores = loop.run(run.policy.evaluate())
    return {"reward": scores["eval/reward"], "num_prompts": scores["eval/num_prompts"],
            "num_errors": scores["eval/num_errors"], "response_len_mean": scores["eval/response_len_mean"],
            "eval_s": round(scores["eval/s"], 3), **where, "task": cfg.task.type}


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 and one JSON line; 2 with one line on stderr when the
    target, the config or the model is wrong."""
    p = argparse.ArgumentParser(
        prog="python -m actors.evaluate",
        description="Score a run's final weights, or a model directory, on the task's held-out prompts "
                    "with the task's reward; prints one JSON line.")
    p.add_argument("target", help="a run directory (runs/<name>-<time>-<pid>), one of its checkpoints/step-N, "
                                  "or a Hugging Face model directory (an export)")
    p.add_argument("config", nargs="?", help="for a model directory: the YAML config whose task scores it "
                                             "(default: the run it was exported from, else the defaults)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="e.g. task.kwargs.eval_path=held_out.jsonl policy.eval_prompts=200")
    p.add_argument("--traceback", action="store_true", help="on an error, print its whole traceback")
    args = p.parse_intermixed_args(argv)
    config = args.config
    if config is not None and "=" in config:  # an override, not a config file
        args.overrides.insert(0, config)
        config = None
    try:
        result = evaluate(args.target, config, args.overrides)
    except Exception as err:  # noqa: BLE001 - the command line's boundary: one line, not a traceback
        if args.traceback:
            traceback.print_exception(err)
        what = " ".join(str(err).split()) or type(err).__name__
        if not isinstance(err, (ValueError, OSError)):
            what = f"{type(err).__name__}: {what}"
        print(f"error: {what}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
