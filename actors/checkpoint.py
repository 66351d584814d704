"""Run checkpoints on disk: what ``--resume`` needs, written atomically,
checked on the way back.

    <run dir>/checkpoints/step-000010/
        trainer/         the trainer backend's checkpoint (HF-loadable config + model.safetensors,
                         optimizer.pt, trainer_state.json) and each worker's torch RNG (rng-rank<r>.pt)
        queue.msgpack    the TransferQueue's unsettled samples and counters (transfer_queue.persist)
        state.json       the policy's counters and admission state, the driver's RNG states,
                         the engines' weight version, how far metrics.jsonl had got
        config.yaml      the resolved config
        MANIFEST.json    written last: format version, step, and the size and sha256 of every other file

Writing (:func:`commit`): the parts go into ``checkpoints/.step-000010.tmp-<pid>``,
every file is hashed and fsynced, the manifest is written last, and the directory
is renamed into place; then all but the newest ``keep`` checkpoints are deleted.
A crash leaves either a ``.tmp`` directory (ignored, removed by the next run on this
directory) or a whole checkpoint. Reading (:func:`find`): a checkpoint without a
manifest, or whose files differ from it (truncated, rewritten, missing), is torn;
the newest whole one is used and the torn ones are named.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import random
import re
import shutil
import time

import numpy as np
import torch

__all__ = ["FORMAT_VERSION", "checkpoints_dir", "commit", "driver_rng_state", "find", "list_checkpoints", "new_tmp_dir",
           "read_state", "remove_tmp_dirs", "restore_metrics", "set_aside_later", "set_driver_rng_state", "verify"]

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"^step-(\d+)$")
_CHUNK_BYTES = 1 << 20


def checkpoints_dir(run_dir: pathlib.Path) -> pathlib.Path:
    return run_dir / "checkpoints"


def new_tmp_dir(run_dir: pathlib.Path, step: int) -> pathlib.Path:
    """An empty directory to write the checkpoint of ``step`` into (then :func:`commit` it)."""
    tmp = checkpoints_dir(run_dir) / f".step-{step:06d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
        os.fsync(f.fileno())  # on disk before the manifest that vouches for it
    return h.hexdigest()


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def commit(tmp: pathlib.Path, run_dir: pathlib.Path, step: int, keep: int) -> pathlib.Path:
    """Seal the checkpoint written into ``tmp`` (manifest last), move it into
    place as ``checkpoints/step-<step>``, keep the newest ``keep``; returns its path."""
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _files(tmp)}
    for d in sorted({p.parent for p in _files(tmp)}, key=lambda d: -len(d.parts)):
        _fsync_dir(d)
    manifest = {"format_version": FORMAT_VERSION, "step": step, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = checkpoints_dir(run_dir) / f"step-{step:06d}"
    if final.exists():  # a torn one of this step (the run resumed from an earlier one): replaced
        old = final.with_name(f".{final.name}.replaced-{os.getpid()}")
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    for path, _ in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def list_checkpoints(run_dir: pathlib.Path) -> list[tuple[pathlib.Path, int]]:
    """``(path, step)`` of every ``step-<N>`` directory, oldest first (torn ones too)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(p, int(m.group(1))) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found, key=lambda item: item[1])


def remove_tmp_dirs(run_dir: pathlib.Path) -> None:
    """Remove what writers that died left half-written (``.step-*.tmp-*`` and the like)."""
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("."):
                shutil.rmtree(p, ignore_errors=True)


def verify(path: pathlib.Path) -> str | None:
    """None when ``path`` is a whole checkpoint; else what is wrong with it."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return f"no {MANIFEST} (it is written last: the checkpoint was not finished)"
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
        version = manifest["format_version"]
    except (ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__}: {err})"
    if version != FORMAT_VERSION:
        return f"format_version {version}, this build reads {FORMAT_VERSION}"
    for name in ("state.json", "config.yaml", "queue.msgpack"):
        if name not in files:
            return f"{MANIFEST} lists no {name}"
    for name, meta in files.items():
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if _sha256(p) != meta["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def find(path: str | pathlib.Path) -> tuple[pathlib.Path, list[tuple[pathlib.Path, str]]]:
    """The checkpoint to resume from: ``path`` itself when it is a checkpoint
    directory, else the newest whole checkpoint of run directory ``path``.
    Returns it with the newer checkpoints skipped as torn, each with why.
    ``ValueError`` (naming the path) when there is none."""
    p = pathlib.Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"--resume {str(p)!r}: no such run directory")
    if _NAME.match(p.name) and p.parent.name == "checkpoints":
        reason = verify(p)
        if reason is not None:
            raise ValueError(f"checkpoint {str(p)!r} is torn: {reason}")
        return p, []
    found = list_checkpoints(p)
    if not found:
        raise ValueError(f"--resume {str(p)!r}: no checkpoint in {str(checkpoints_dir(p))!r} (a run writes one "
                         "every run.checkpoint_every steps, when stopped by SIGTERM or SIGINT, and when it closes "
                         "after training unless run.save_final=false)")
    skipped = []
    for ckpt, _ in reversed(found):
        reason = verify(ckpt)
        if reason is None:
            return ckpt, skipped
        skipped.append((ckpt, reason))
    raise ValueError(f"--resume {str(p)!r}: every checkpoint is torn: " +
                     "; ".join(f"{c.name}: {why}" for c, why in skipped))


def read_state(ckpt: pathlib.Path) -> dict[str, object]:
    return json.loads((ckpt / "state.json").read_text())


def restore_metrics(run_dir: pathlib.Path, num_bytes: int) -> tuple[dict[str, object] | None, list[dict[str, object]]]:
    """Cut ``metrics.jsonl`` back to the checkpoint's ``num_bytes`` (the records after
    it, of steps the crash lost, move to ``metrics.rolled_back.jsonl``); returns the
    records kept: the evaluation before step 1 (or None) and one per step."""
    path = run_dir / "metrics.jsonl"
    data = path.read_bytes() if path.is_file() else b""
    if len(data) > num_bytes:
        with open(run_dir / "metrics.rolled_back.jsonl", "ab") as f:
            f.write(data[num_bytes:])
        with open(path, "r+b") as f:
            f.truncate(num_bytes)
        data = data[:num_bytes]
    initial_eval, history = None, []
    for line in data.decode().splitlines():
        record = json.loads(line)
        if record.get("step") == 0:
            initial_eval = record
        else:
            history.append(record)
    return initial_eval, history


def set_aside_later(run_dir: pathlib.Path, step: int) -> None:
    """A run resumed from the checkpoint of ``step``: later checkpoints belong to
    the timeline the crash ended. Torn ones are removed, whole ones (an older
    checkpoint chosen by hand) renamed ``step-<N>.superseded-<time>`` so no later
    resume takes them; half-written directories are removed."""
    remove_tmp_dirs(run_dir)
    for path, later in list_checkpoints(run_dir):
        if later <= step:
            continue
        if verify(path) is None:
            path.rename(path.with_name(f"{path.name}.superseded-{time.strftime('%Y%m%d-%H%M%S')}"))
        else:
            shutil.rmtree(path, ignore_errors=True)


# -- the driver's RNG states ------------------------------------------------------

def driver_rng_state() -> dict[str, object]:
    """This process's python, numpy and torch (CPU) RNG states, as JSON values."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
            "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def set_driver_rng_state(state: dict[str, object]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
