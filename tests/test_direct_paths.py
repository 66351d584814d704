"""The driver carries control only: every sample goes rollout actor →
TransferQueue → trainer actor and every weight payload trainer → engines.

Each test runs a short real fully-async run (first sync full, then deltas)
and inspects every message the driver sends to or receives from an actor or
the queue: the bytes of sample payload (Sample objects, token arrays) and of
weight payload (tensors, arrays, raw buffers) must be zero, while control
messages flow (their count is checked, so the probe cannot pass by seeing nothing).
"""

from __future__ import annotations

import pathlib
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from actors import runtime as rt
from actors.launch import launch
from contracts.sample import Sample
from contracts.weights import WeightUpdate
from transfer_queue import rpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHORT = ["trainer.batch_prompts=2", "rollout.n=4", "run.progress=false", "rollout.max_response_tokens=8",
         "sync.mode=delta"]


def payload_bytes(obj: Any, _depth: int = 0) -> int:
    """Bytes of sample or weight payload anywhere inside ``obj``."""
    if _depth > 20 or obj is None or isinstance(obj, (bool, int, float, str)):
        return 0
    if isinstance(obj, Sample):
        return max(1, sum(np.asarray(getattr(obj, f)).nbytes for f in
                          ("prompt_ids", "response_ids", "rollout_logprobs", "token_versions")))
    if isinstance(obj, torch.Tensor):
        return max(1, obj.numel() * obj.element_size())
    if isinstance(obj, np.ndarray):
        return max(1, obj.nbytes)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj) if len(obj) > 64 else 0  # a secret or a token is not payload
    if isinstance(obj, dict):
        return sum(payload_bytes(k, _depth + 1) + payload_bytes(v, _depth + 1) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(payload_bytes(x, _depth + 1) for x in obj)
    if isinstance(obj, msgspec.Struct):
        return sum(payload_bytes(getattr(obj, f), _depth + 1) for f in obj.__struct_fields__)
    return 0


def test_the_probe_sees_samples_tensors_and_weight_buckets() -> None:
    s = Sample(uid="a", group_id="g", prompt_ids=[1, 2, 3])
    assert payload_bytes({"x": [s]}) > 0
    assert payload_bytes((1, "m", torch.zeros(4))) == 16
    assert payload_bytes(WeightUpdate(manifest=None, buckets=[np.zeros(100, np.uint8)])) == 100
    assert payload_bytes({"step": 3, "reward": 0.5, "dropped": {"stale": 2}}) == 0


class _Probe:
    """Counts the driver's messages and the payload bytes inside them."""

    def __init__(self) -> None:
        self.messages = Counter[str]()
        self.payload: Counter[str] = Counter()

    def see(self, where: str, obj: Any) -> None:
        self.messages[where] += 1
        n = payload_bytes(obj)
        if n:
            self.payload[where] += n


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> _Probe:
    p = _Probe()

    def wrap(cls: type, name: str) -> None:
        call = getattr(cls, name)

        async def probed(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
            p.see(f"{cls.__name__}.{method} (sent)", (args, kwargs))
            result = await call(self, method, *args, **kwargs)
            p.see(f"{cls.__name__}.{method} (received)", result)
            return result

        monkeypatch.setattr(cls, name, probed)

    # every actor call of the driver (process, ray and local runtimes) and every
    # message of its TransferQueue client (the socket transport of both served deployments)
    for cls in (rt._ProcessHandle, rt._RayHandle, rt._LocalHandle):
        wrap(cls, "call")
    wrap(rpc.RpcClient, "call")
    wrap(rpc.RpcClient, "send")
    return p


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _train(probe: _Probe, tmp_path: pathlib.Path, *overrides: str) -> Any:
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"run.output_dir={tmp_path}", *overrides)
    with run:
        probe.messages.clear()  # setup (spawn arguments: configs, the queue's address) is not the run
        run.train(steps=3)
    kinds = [m["sync/kind"] for m in run.history]
    assert kinds[0] == "full" and kinds[1:] == ["delta", "delta"], kinds
    assert run.history[-1]["trained"] == 3 * 2 * 4
    assert probe.messages, "the probe saw no driver message: it is not wired"
    assert not probe.payload, f"payload through the driver: {dict(probe.payload)}"
    return run


def test_process_runtime_driver_carries_control_only(probe: _Probe, tmp_path: pathlib.Path) -> None:
    run = _train(probe, tmp_path, "runtime.type=process", "transfer_queue.deployment=local")
    assert run.weight_transport == "dist"  # CPU processes: a gloo broadcast from the trainer
    assert any(k.startswith("_ProcessHandle.train_step") for k in probe.messages)
    assert any(k.startswith("RpcClient.call") for k in probe.messages)  # the queue's counters


@pytest.mark.ray
@pytest.mark.parametrize("deployment", ["local", "ray"])
def test_ray_runtime_driver_carries_control_only(deployment: str, probe: _Probe, tmp_path: pathlib.Path,
                                                 ray_cluster: Any) -> None:
    run = _train(probe, tmp_path, "runtime.type=ray", f"transfer_queue.deployment={deployment}")
    assert run.weight_transport == "dist"
    assert any(k.startswith("_RayHandle.generate_group") for k in probe.messages)


def test_local_runtime_policy_never_holds_a_sample_or_a_weight_tensor(probe: _Probe, tmp_path: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from policies.base import PolicyBase

    queue_calls = Counter[str]()
    init = PolicyBase.__init__

    def watched(self: Any, cfg: Any, *, queue: Any, **kwargs: Any) -> None:
        class _Watch:  # what the policy asks of the queue
            def __getattr__(self, name: str) -> Any:
                queue_calls[name] += 1
                return getattr(queue, name)

        init(self, cfg, queue=_Watch(), **kwargs)

    monkeypatch.setattr(PolicyBase, "__init__", watched)
    run = _train(probe, tmp_path, "runtime.type=local")
    assert run.weight_transport == "inproc"
    assert set(queue_calls) <= {"statistics_async", "close"}, queue_calls
    assert any(k.startswith("_LocalHandle.weight_update (received)") for k in probe.messages)


def test_a_failed_train_step_hands_its_batch_back_to_the_queue(tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer acks only after its step; a step that raises nacks, so none
    of the batch's samples is lost or left leased."""
    import loop
    from actors.backends.torch_backend import TorchBackend

    def broken(self: Any, samples: Any, advantages: Any) -> Any:
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(TorchBackend, "train_step", broken)
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"run.output_dir={tmp_path}")
    with run:
        with pytest.raises(RuntimeError, match="injected"):
            run.train(steps=1)
        stats = loop.run(run.queue.statistics_async())
        assert stats.in_flight == 0 and stats.delivered == 0
        assert stats.redelivered == run.cfg.batch_size and stats.pending >= run.cfg.batch_size
