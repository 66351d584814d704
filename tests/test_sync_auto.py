"""``sync.mode: auto``, the default: full where a push is a device copy on one
host, delta across slower links and on the CPU (``sync/auto.py``); a run shows
what it became."""

from __future__ import annotations

import pathlib

import pytest
import torch

from actors.config import load_config
from actors.launch import launch
from sync import SyncConfig, WeightSender, encode
from sync.auto import TRANSPORTS, mode_for
from tests.helpers import train_checking_engine_weights

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHORT = ["trainer.batch_prompts=2", "rollout.n=4", "run.progress=false", "rollout.max_response_tokens=8"]


@pytest.mark.parametrize(("transport", "device", "mode"), [
    ("inproc", "cuda", "full"), ("inproc", "cuda:1", "full"), ("cuda_ipc", "cuda:0", "full"),
    ("inproc", "cpu", "delta"), ("broadcast", "cuda", "delta"), ("broadcast", "cpu", "delta"),
    ("ray", "cuda", "delta"), ("ray", "cpu", "delta")])
def test_auto_pushes_full_for_device_copies_on_one_host_and_delta_elsewhere(transport, device, mode):
    assert mode_for(transport, device) == mode
    assert SyncConfig().mode_for(transport, device) == mode


def test_sync_mode_defaults_to_auto_in_the_config_the_reference_file_and_the_sender():
    assert SyncConfig().mode == "auto"
    assert load_config(ROOT / "fully_async.yaml", []).sync.mode == "auto"
    assert WeightSender().mode == "auto"


@pytest.mark.parametrize("mode", ["full", "delta"])
def test_a_mode_the_user_gives_is_kept_on_every_transport_and_device(mode):
    cfg = SyncConfig(mode=mode)
    assert {cfg.mode_for(t, d) for t in TRANSPORTS for d in ("cpu", "cuda")} == {mode}


def test_an_unknown_transport_is_one_line_naming_it():
    with pytest.raises(ValueError, match="'nvlink'"):
        mode_for("nvlink", "cuda")
    with pytest.raises(ValueError, match="'nvlink'"):
        WeightSender(transport="nvlink")


def test_a_sender_in_auto_asks_the_rule_once_with_its_transport_and_the_weights_device(monkeypatch):
    asked = []
    monkeypatch.setattr(encode, "mode_for", lambda transport, device: asked.append((transport, device)) or "full")
    w = {"w": torch.zeros(64)}
    sender = WeightSender(transport="cuda_ipc", dtype=torch.float32)
    kinds = []
    for v in (1, 2, 3):
        w["w"][v] += 1.0
        kinds.append(sender.encode(w, v).manifest.kind)
    assert asked == [("cuda_ipc", "cpu")] and sender.mode == "full" and kinds == ["full", "full", "full"]


def test_several_trainer_workers_take_the_default_mode_since_each_resolves_it_alike():
    cfg = load_config(ROOT / "fully_async.yaml", ["trainer.num_workers=2", "runtime.type=process"])
    assert cfg.sync.mode == "auto" and cfg.trainer.num_workers == 2


def test_a_local_cpu_run_with_the_default_pushes_deltas_and_records_what_auto_became(tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"run.output_dir={tmp_path}")
    assert (run.cfg.sync.mode, run.weight_transport, run.weight_mode) == ("auto", "inproc", "delta")
    with run:
        train_checking_engine_weights(run, steps=3, dtype="float32")
        first = run.history[0]
        assert (first["startup/sync_transport"], first["startup/sync_mode"]) == ("inproc", "delta")
        assert [m["sync/kind"] for m in run.history] == ["full", "delta", "delta"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("runtime", "transport"), [("local", "inproc"), ("process", "cuda_ipc")])
def test_a_gpu_run_with_the_default_pushes_full_in_one_process_and_over_cuda_ipc(tmp_path, runtime, transport):
    run = launch(ROOT / "fully_async.yaml", f"runtime.type={runtime}", "trainer.device=cuda",
                 "rollout.engine.device=cuda", "rollout.engine.dtype=bfloat16", *SHORT, f"run.output_dir={tmp_path}")
    assert (run.weight_transport, run.weight_mode) == (transport, "full")
    with run:
        train_checking_engine_weights(run, steps=3)
        assert [m["sync/kind"] for m in run.history] == ["full", "full", "full"]
        assert run.history[0]["startup/sync_mode"] == "full"
