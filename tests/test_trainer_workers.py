"""Several trainer actors (``trainer.num_workers``): the config refuses what
cannot work, step reports merge, and a real run with two workers in their own
processes trains every sample once and keeps every engine bit-exact with the
trainers' weights assembled from their shards after every (sharded) push.
The backend's own data-parallel arithmetic is in tests/test_trainer_dp.py."""

from __future__ import annotations

import inspect
import pathlib
import typing

import pytest

from actors.config import ConfigError, load_config
from actors.launch import launch
from actors.rollout import RolloutActor
from actors.trainer import TrainerActor
from actors.trainer_group import TrainerGroup, merge_reports
from contracts.handles import RolloutHandle, TrainerHandle, TrainerWorkerHandle
from contracts.training import StepReport
from tests.helpers import train_checking_engine_weights

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.num_workers=2", "runtime.type=local"], "need one process each"),
    (["trainer.num_workers=2", "runtime.type=process", "trainer.batch_prompts=3"], "not a multiple"),
])
def test_config_refuses_what_several_workers_cannot_do(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "fully_async.yaml", overrides)


def _endpoints(protocol: type) -> list[str]:
    """The async methods a handle Protocol declares, its bases' included."""
    return sorted({name for base in protocol.__mro__ if typing.Protocol in base.__bases__ or base is protocol
                   for name, fn in vars(base).items() if inspect.iscoroutinefunction(fn)})


def _signature(fn: typing.Any) -> tuple:
    """Parameters (name, kind, default) and resolved annotations of ``fn``, ``self`` left out,
    and Ray's ``_ray_trace_ctx`` too (added to an actor class's methods once Ray wraps it)."""
    params = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
              if p.name != "_ray_trace_ctx"][1:]
    return params, {k: v for k, v in typing.get_type_hints(fn).items() if k != "_ray_trace_ctx"}


@pytest.mark.parametrize(("cls", "protocol"), [
    (TrainerActor, TrainerWorkerHandle), (TrainerGroup, TrainerHandle), (RolloutActor, RolloutHandle)])
def test_actors_and_the_trainer_group_have_every_endpoint_of_their_handle(cls: type, protocol: type) -> None:
    endpoints = _endpoints(protocol)
    assert len(endpoints) >= 15, endpoints
    for name in endpoints:
        fn = getattr(cls, name, None)
        assert inspect.iscoroutinefunction(fn), f"{cls.__name__}.{name} is not an async endpoint"
        assert _signature(fn) == _signature(getattr(protocol, name)), f"{cls.__name__}.{name}"


def test_the_trainer_group_stands_in_for_one_trainer_actor() -> None:
    for name in _endpoints(TrainerHandle):
        assert _signature(getattr(TrainerGroup, name)) == _signature(getattr(TrainerActor, name)), name


def test_an_endpoint_that_answers_must_say_how_the_group_merges_its_workers_answers() -> None:
    from actors.trainer_group import Fan, _endpoints_of

    class Handle(typing.Protocol):
        async def count(self) -> int: ...

        async def reset(self) -> None: ...

    with pytest.raises(TypeError, match="FAN_OUT"):
        _endpoints_of(Handle, {})(type("Group", (), {}))
    group = _endpoints_of(Handle, {"count": Fan(merge=sum)})(type("Group", (), {}))
    assert inspect.iscoroutinefunction(group.count) and inspect.iscoroutinefunction(group.reset)


def test_step_reports_merge() -> None:
    a = StepReport(version=3, num_samples=4, num_tokens=40, wait_s=0.1, train_s=1.0, dropped={"stale": 1},
                   metrics={"reward": 1.0, "staleness_max": 1, "train/loss": 0.5})
    b = StepReport(version=3, num_samples=12, num_tokens=60, wait_s=0.3, train_s=0.5, dropped={"stale": 2, "x": 1},
                   metrics={"reward": 0.0, "staleness_max": 2, "train/loss": 0.5})
    m = merge_reports([a, b])
    assert (m.num_samples, m.num_tokens, m.wait_s, m.train_s) == (16, 100, 0.3, 1.0)
    assert m.dropped == {"stale": 3, "x": 1}
    assert m.metrics == {"reward": 0.25, "staleness_max": 2, "train/loss": 0.5}
    with pytest.raises(RuntimeError, match="disagree"):
        merge_reports([a, StepReport(version=4, num_samples=1, num_tokens=1, wait_s=0, train_s=0)])


def test_two_trainer_workers_train_every_sample_once_and_push_their_shards(tmp_path: pathlib.Path) -> None:
    import loop

    run = launch(ROOT / "fully_async.yaml", "runtime.type=process", "trainer.num_workers=2",
                 "rollout.num_actors=2", "rollout.engine.dtype=bfloat16", "trainer.lr=1e-4", "sync.mode=delta",
                 "trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8", "run.progress=false",
                 f"run.output_dir={tmp_path}")
    with run:
        assert run.weight_transport == "broadcast"
        before = loop.run(run.policy.trainer.weights_digest("float32"))
        train_checking_engine_weights(run, steps=3)  # engines == the workers' shards assembled, bit for bit
        assert loop.run(run.policy.trainer.weights_digest("float32")) != before  # it trained
        assert [m["sync/kind"] for m in run.history] == ["full", "delta", "delta"]
        last = run.history[-1]
        assert last["trained"] == 3 * 2 * 4
        assert last["produced"] == last["trained"] + sum(last["dropped"].values()) + last["pending"]
        stats = loop.run(run.queue.statistics_async())
        assert stats.in_flight == 0 and stats.delivered == last["trained"]
