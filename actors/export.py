"""Export a trained policy as a Hugging Face model directory.

    python -m actors.export runs/<dir> <out> [--dtype bfloat16]   # the run's newest whole checkpoint
    run.export_hf(out)                                             # a live run's current weights

    <out>/config.json            the model's architecture (the model.path one's: Qwen2, Llama, Qwen3)
          model.safetensors      the trained weights in Hugging Face names (or shards + their index)
          generation_config.json the model directory's own (else one derived from config.json)
          tokenizer files        the model directory's own (tokenizer.json, tokenizer_config.json, ...)
          export.json            where it came from: run directory, step, source model

A run checkpoint's ``trainer/`` part is already an HF checkpoint of the model's
own architecture (the torch backend saves the HF model it trains, whatever the
number of workers; the megatron backend converts back to HF names), so an export
copies it without the optimizer state and RNG files and adds what serving needs
from the run's ``model.path`` directory: the tokenizer and the generation
config. The multi-token prediction modules of a run with ``model.mtp_layers`` are in the
trainer checkpoint under their spec names (``mtp.{k}.*``, docs/mtp.md) and so in the
export too: transformers skips them, a run or engine with ``model.mtp_layers`` reads them.
The built-in tiny-qwen2 is a plain ``Qwen2ForCausalLM``, so its exports
are too. The directory loads with ``transformers.AutoModelForCausalLM`` and is a
``model.path`` for a new run (the built-in engine, vLLM). A model directory
without tokenizer files (a run on a built-in symbol task builds its tokenizer)
gets the task's tokenizer saved.

Part of the composition root (it reads the run's config): nothing but
the composition root (``actors/notebook_api.py``, ``actors/launch.py``), tools and tests imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.run import Run

from actors import checkpoint
from actors.config import Config, load_resume_config
from actors.models import resolve_model_path

__all__ = ["TOKENIZER_FILES", "export_checkpoint", "export_run", "main", "write_hf_dir"]

#: Tokenizer files copied from the model directory when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
_DTYPES = ("float32", "bfloat16", "float16")


def _weight_files(trainer_dir: pathlib.Path) -> list[str]:
    """The safetensors files of the HF checkpoint in ``trainer_dir`` (one file, or an index and its shards)."""
    if (trainer_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    index = trainer_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return ["model.safetensors.index.json", *shards]
    raise ValueError(f"{str(trainer_dir)!r} holds no model.safetensors (nor an index of shards)")


def _copy_weights(src: pathlib.Path, dst: pathlib.Path, dtype: str | None) -> None:
    """The weights and config.json, cast to ``dtype`` (floating tensors only) when given."""
    files = _weight_files(src)
    if dtype is None:
        for name in [*files, "config.json"]:
            shutil.copyfile(src / name, dst / name)
        return
    import safetensors.torch
    import torch

    target = getattr(torch, dtype)
    for name in files:
        if not name.endswith(".safetensors"):
            shutil.copyfile(src / name, dst / name)
            continue
        tensors = safetensors.torch.load_file(str(src / name))
        cast = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
        safetensors.torch.save_file(cast, str(dst / name), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = dtype  # the key transformers >= 4.56 writes; older ones read torch_dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _tokenizer_and_generation_config(model_dir: pathlib.Path, cfg: Config, dst: pathlib.Path) -> None:
    copied = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    for name in copied:
        shutil.copyfile(model_dir / name, dst / name)
    if not copied:  # the task built its own tokenizer (the built-in symbol tasks): save that one
        from policies.tasks import make_task

        try:
            tokenizer = make_task(cfg.task.type, model_path=str(model_dir), **cfg.task.kwargs).tokenizer
            tokenizer.save_pretrained(str(dst))
        except Exception as e:  # noqa: BLE001 - any failure means there is no tokenizer to export
            raise ValueError(f"model path {str(model_dir)!r} has no tokenizer files and task {cfg.task.type!r} "
                             f"gives none ({type(e).__name__}: {e})") from None
    if (model_dir / "generation_config.json").is_file():
        shutil.copyfile(model_dir / "generation_config.json", dst / "generation_config.json")
    else:
        import transformers

        config = transformers.AutoConfig.from_pretrained(str(dst), local_files_only=True)
        transformers.GenerationConfig.from_model_config(config).save_pretrained(str(dst))


def write_hf_dir(trainer_dir: str | pathlib.Path, cfg: Config, out: str | pathlib.Path, *,
                 dtype: str | None = None, source: dict[str, object] | None = None) -> pathlib.Path:
    """Write the HF model directory ``out`` from the trainer checkpoint in
    ``trainer_dir`` and the run's ``model.path`` (tokenizer, generation config).
    ``out`` must not exist or be empty; it appears whole or not at all (written
    beside it, then renamed). ``dtype``: cast the weights (default: as trained).
    ``source``: what :file:`export.json` records. Returns ``out``, absolute."""
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown (expected one of: {', '.join(_DTYPES)})")
    trainer_dir = pathlib.Path(trainer_dir)
    out = pathlib.Path(out).expanduser().absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"export directory {str(out)!r} exists and is not empty")
    model_dir = resolve_model_path(cfg.model.path, cfg.base_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _copy_weights(trainer_dir, staging, dtype)
        _tokenizer_and_generation_config(model_dir, cfg, staging)
        record = {**(source or {}), "base_model": str(model_dir), "dtype": dtype or "as trained"}
        (staging / "export.json").write_text(json.dumps(record, indent=1) + "\n")
        os.replace(staging, out)  # onto an empty directory too
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def export_checkpoint(path: str | pathlib.Path, out: str | pathlib.Path, *, dtype: str | None = None) -> pathlib.Path:
    """Export the newest whole checkpoint of run directory ``path`` (or the
    checkpoint directory ``path``) to ``out``; ``ValueError`` naming what is
    missing (the run directory, any checkpoint, the run's model directory)."""
    try:
        ckpt, skipped = checkpoint.find(path)
    except ValueError as err:  # its messages are written for --resume
        hint = "; a live run exports with run.export_hf(path)" if "no checkpoint" in str(err) else ""
        raise ValueError(str(err).replace("--resume ", "", 1) + hint) from None
    for torn, why in skipped:
        print(f"warning: checkpoint {torn} is torn ({why}); exporting {ckpt.name}", file=sys.stderr)
    cfg = load_resume_config(ckpt / "config.yaml")
    source = {"run_dir": str(ckpt.parents[1].absolute()), "checkpoint": ckpt.name,
              "step": checkpoint.read_state(ckpt)["step"]}
    return write_hf_dir(ckpt / "trainer", cfg, out, dtype=dtype, source=source)


async def export_run(run: Run, out: str | pathlib.Path, *, dtype: str | None = None) -> pathlib.Path:
    """``Run.export_hf``: the trainer's current weights (its push settled), saved
    by the trainer into a scratch directory of the run (the backend's HF
    checkpoint, every worker's shards gathered), then written as ``out``."""
    await run.policy.settle()
    scratch = run.dir / f".export-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        await run.policy.trainer.save(str(scratch))
        source = {"run_dir": str(run.dir.absolute()), "step": run.policy.step}
        return write_hf_dir(scratch, run.cfg, out, dtype=dtype, source=source)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 and a JSON line after an export; 2 with one line on
    stderr when the run directory, its checkpoint or the output is wrong."""
    p = argparse.ArgumentParser(
        prog="python -m actors.export",
        description="Write a run's newest whole checkpoint as a Hugging Face model directory "
                    "(config.json, model.safetensors, tokenizer, generation_config.json).")
    p.add_argument("run_dir", help="a run directory (runs/<name>-<time>-<pid>) or one of its checkpoints/step-N")
    p.add_argument("out", help="the directory to write (must not exist, or be empty)")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="cast the weights (default: as trained)")
    p.add_argument("--traceback", action="store_true", help="on an error, print its whole traceback")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.out, dtype=args.dtype)
    except (ValueError, OSError) as err:
        if args.traceback:
            traceback.print_exception(err)
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(json.dumps({"exported": str(out), **json.loads((out / "export.json").read_text())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
