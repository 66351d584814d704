"""run.loggers (issue 22 item 2): the default job, run from the command line with
TensorBoard and W&B (offline) enabled, writes the same metric names and values at
the same steps as metrics.jsonl, read back from the event files (as scalars, the
form ``tensorboard --logdir`` charts: issue 30) and from the W&B run file; the
resolved config is logged as hyperparameters; a resumed run's steps replace the
rolled-back ones; bad logger lists are refused at load."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from actors.config import ConfigError, load_config
from actors.loggers import flatten
from tests.extras import needs_mark

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8", "run.progress=false"]
ALL = "run.loggers=[jsonl,tensorboard,wandb]"

pytestmark = pytest.mark.timeout(240)
needs_tensorboard, needs_wandb = needs_mark("tensorboard", "tensorboard"), needs_mark("wandb", "wandb")


def _cli(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m actors.launch`` with W&B kept inside ``tmp_path`` (no login, no network:
    the config's wandb_mode is offline by default; WANDB_MODE says it again)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"), WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    proc = subprocess.run([sys.executable, "-m", "actors.launch", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _records(run_dir: pathlib.Path) -> dict[int, tuple[dict, dict]]:
    """step -> (scalars, texts) of every metrics.jsonl record."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        step, scalars, texts = flatten(json.loads(line))
        out[step] = (scalars, texts)
    return out


def _tensorboard(run_dir: pathlib.Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _tb_texts(acc, tag: str) -> dict[int, bytes]:
    from tensorboard.util import tensor_util

    return {e.step: tensor_util.make_ndarray(e.tensor_proto).item() for e in acc.Tensors(tag)}


def _tb_scalars(acc, tag: str) -> dict[int, float]:
    """The scalars TensorBoard charts (``Scalars`` raises KeyError for a tag logged in
    another form, such as the float64 tensors its default fast loader drops)."""
    return {e.step: e.value for e in acc.Scalars(tag)}


def _f32(value: float) -> float:
    """``value`` as a TensorBoard scalar holds it: float32 (``simple_value``)."""
    return float(np.float32(value))


def _wandb_records(path: pathlib.Path):
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte header,
    then LevelDB-log-style 32 KiB blocks of chunks (crc32 4, length 2, type 1:
    full / first / middle / last). wandb no longer ships a reader of its own."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_run(run_dir: pathlib.Path) -> tuple[dict[int, dict], dict]:
    """(step -> {key: value} of the history, the run's config) of every offline run under ``run_dir/wandb``."""
    history, config = {}, {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "run":
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    return history, config


@needs_tensorboard
@needs_wandb
def test_the_default_job_logs_the_same_metrics_to_tensorboard_and_wandb_as_to_metrics_jsonl(tmp_path):
    _cli(tmp_path, "fully_async.yaml", *SMALL, "run.total_steps=3", "policy.eval_every=2",
         f"run.output_dir={tmp_path / 'runs'}", ALL)
    (run_dir,) = (tmp_path / "runs").iterdir()
    expected = _records(run_dir)
    assert sorted(expected) == [0, 1, 2, 3]  # the evaluation before step 1, then one record a step
    assert "eval/reward" in expected[0][0] and "sync/kind" in expected[1][1]

    acc = _tensorboard(run_dir)
    assert set(acc.Tags()["scalars"]) == {k for scalars, _ in expected.values() for k in scalars}
    for tag in acc.Tags()["scalars"]:
        want = {step: _f32(scalars[tag]) for step, (scalars, _) in expected.items() if tag in scalars}
        # metrics.jsonl's values within float32 precision: each is the float32 nearest to it, exactly
        assert _tb_scalars(acc, tag) == want, tag
    texts = {t.removesuffix("/text_summary") for t in acc.Tags()["tensors"] if t.endswith("/text_summary")}
    assert set(acc.Tags()["tensors"]) == {f"{t}/text_summary" for t in texts}  # no scalar as a tensor
    assert {k for _, t in expected.values() for k in t} | {"config", "samples"} == texts
    shown = _tb_texts(acc, "samples/text_summary")  # samples.jsonl's rows of step 1 (run.log_samples_every)
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert list(shown) == [1] and all(row["completion"] in shown[1].decode() for row in rows)
    assert _tb_texts(acc, "sync/kind/text_summary")[1] == b"full"
    assert b"trainer.lr" in acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]

    history, config = _wandb_run(run_dir)
    assert sorted(history) == sorted(expected)
    for step, (scalars, texts) in expected.items():
        assert history[step] == {**scalars, **texts}, step  # the JSON values metrics.jsonl holds
    assert config["trainer"]["lr"] == 2e-4 and config["run"]["loggers"] == ["jsonl", "tensorboard", "wandb"]


@needs_tensorboard
@needs_wandb
def test_a_resumed_run_replaces_the_rolled_back_steps_in_tensorboard_and_continues_the_wandb_run(tmp_path):
    out = tmp_path / "runs"
    _cli(tmp_path, "fully_async.yaml", *SMALL, "run.total_steps=3", "run.checkpoint_every=2",
         "run.save_final=false", f"run.output_dir={out}", ALL)  # resumed from step 2, not the end
    (run_dir,) = out.iterdir()
    _cli(tmp_path, "--resume", str(run_dir), "run.total_steps=4")  # from step 2: step 3 is trained again
    expected = _records(run_dir)
    assert sorted(expected) == [1, 2, 3, 4] and "resumed_from" in expected[3][1]
    assert len(list(run_dir.glob("tensorboard/events.out.tfevents.*"))) == 2
    # the first process's step 3 is hidden (purged from step 3 on): each step's value is metrics.jsonl's
    rewards = _tb_scalars(_tensorboard(run_dir), "reward")
    assert rewards == {step: _f32(scalars["reward"]) for step, (scalars, _) in expected.items()}
    runs = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(f"-{run_dir.name}") for p in runs)  # one W&B run id
    history, _ = _wandb_run(run_dir)  # the later file's records win, as a sync would show them
    assert history == {step: {**scalars, **texts} for step, (scalars, texts) in expected.items()}


@pytest.mark.parametrize(("loggers", "message"), [
    ("[jsonl,tensorbord]", "run.loggers.1: invalid enum value 'tensorbord' (expected one of: jsonl, tensorboard, wandb)"),
    ("[tensorboard]", "run.loggers: ['tensorboard'] lacks 'jsonl'"),
    ("[jsonl,wandb,wandb]", "run.loggers: 'wandb' is listed twice"),
])
def test_a_wrong_logger_list_is_refused_at_load_naming_the_key(loggers, message):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "fully_async.yaml", [f"run.loggers={loggers}"])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_a_logger_whose_package_is_missing_is_refused_at_load_naming_the_extra(logger, monkeypatch):
    monkeypatch.setitem(sys.modules, logger, None)  # import fails as if not installed
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "fully_async.yaml", [f"run.loggers=[jsonl,{logger}]"])
    assert str(err.value) == (f"run.loggers: '{logger}' needs the {logger} package, which is not installed; "
                              f"install the optional extra: pip install -e \".[{logger}]\"")
