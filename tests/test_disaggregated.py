"""Trainer and rollout in separate processes (Ray actors, or the process
runtime's children), weights over a
torch.distributed broadcast (gloo): a fully-async run with delta pushes whose
engine weights are bit-identical to the trainer's after every sync."""

from __future__ import annotations

import pathlib

import pytest

from actors.launch import launch
from tests.helpers import train_checking_engine_weights

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("runtime", [pytest.param("ray", marks=pytest.mark.ray), "process"])
def test_fully_async_over_gloo_keeps_engine_weights_bit_exact(tmp_path, runtime):
    run = launch(ROOT / "fully_async.yaml", f"runtime.type={runtime}", "sync.transport=broadcast",
                 "sync.backend=gloo", "rollout.num_actors=2", "rollout.engine.dtype=bfloat16",
                 "trainer.lr=1e-5", "trainer.batch_prompts=2", "rollout.n=4",
                 "rollout.max_response_tokens=8", "run.progress=false", f"run.output_dir={tmp_path}")
    with run:
        train_checking_engine_weights(run, steps=4)
        kinds = [m["sync/kind"] for m in run.history]
        assert kinds == ["full", "delta", "delta", "delta"]
        full_bytes = run.history[0]["sync/bytes_sent"]
        assert all(m["sync/bytes_sent"] < full_bytes / 2 for m in run.history[1:])
        assert all(0.0 < m["sync/changed_fraction"] < 0.5 for m in run.history[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("colocated", [True, False])
def test_cuda_ipc_push_from_the_trainers_gpu_keeps_engine_weights_bit_exact(tmp_path, colocated):
    """Trainer and engine in child processes on one GPU: each push hands the
    engine CUDA IPC handles to the trainer's buckets (no host copy), picked by
    placement with no transport flag. Deltas, the harder kind to keep exact
    (the default pushes full over CUDA IPC)."""
    run = launch(ROOT / "fully_async.yaml", "runtime.type=process", "sync.mode=delta",
                 f"sync.colocated={str(colocated).lower()}", "trainer.device=cuda", "rollout.engine.device=cuda",
                 "rollout.engine.dtype=bfloat16", "trainer.lr=1e-5", "trainer.batch_prompts=2", "rollout.n=4",
                 "rollout.max_response_tokens=8", "run.progress=false", f"run.output_dir={tmp_path}")
    assert run.weight_transport == "cuda_ipc"
    with run:
        train_checking_engine_weights(run, steps=3)
        assert [m["sync/kind"] for m in run.history] == ["full", "delta", "delta"]
