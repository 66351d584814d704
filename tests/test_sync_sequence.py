"""The sync sequence with fake engines: order of steps, retries, and no half-updated fleet."""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.engines.base import RolloutEngine
from contracts.rollout import GenerateOutput
from sync import ChecksumError, SyncFailed, WeightSender, apply_update
from contracts.weights import WeightUpdate, bucket_tensor
from sync.apply import stage_update
from sync.sequence import sync_weights
from sync.transport.inproc import InProcessTransport

pytestmark = [pytest.mark.timeout(30), pytest.mark.asyncio]


class FakeEngine:
    """Holds bf16 weights by HF name and logs every call of the engine surface;
    its swap is the protocol's default, composed of those calls."""

    prepare_swap = RolloutEngine.prepare_swap
    swap_weights = RolloutEngine.swap_weights

    def __init__(self, shapes: dict[str, tuple[int, ...]], log: list[str], idx: int, corrupt: bool = False) -> None:
        self.weights = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
        self.version, self.log, self.idx, self.corrupt = 0, log, idx, corrupt
        self.in_flight = [f"req-{idx}-{i}" for i in range(2)]
        self.paused = False

    def _note(self, what: str) -> None:
        self.log.append(f"{what}:{self.idx}")

    async def pause(self) -> None:
        self.paused = True
        self._note("pause")

    async def resume(self) -> None:
        self.paused = False
        self._note("resume")

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        self._note("abort")
        out = [GenerateOutput(request_id=r, token_ids=[1, 2], finish_reason="abort") for r in self.in_flight]
        self.in_flight = []
        return out

    async def sleep(self, level: int = 1) -> None:
        self._note(f"sleep{level}")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self._note("wake_up")

    async def reset_prefix_cache(self) -> None:
        self._note("reset_prefix_cache")

    async def update_weights(self, update: WeightUpdate) -> int:
        self._note(f"update_{update.manifest.kind}")
        await asyncio.sleep(0)
        if self.corrupt:  # a link that flips a bit in every bucket it carries
            buckets = [bucket_tensor(b).clone() for b in update.buckets]
            for b in buckets:
                b[len(b) // 2] ^= 1
            update = WeightUpdate(manifest=update.manifest, buckets=buckets)
        self.version = apply_update(self.weights, update, self.version)
        return self.version


def _trainer(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(40, 30, generator=g), "b.bias": torch.randn(30, generator=g)}


def _step(w: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in w.values():
        t[torch.rand(t.shape, generator=g) < 0.1] += 0.01


def _fleet(w, n: int, log: list[str], corrupt: int | None = None) -> list[FakeEngine]:
    return [FakeEngine({k: tuple(v.shape) for k, v in w.items()}, log, i, corrupt=(i == corrupt)) for i in range(n)]


def _holds(engine: FakeEngine, w: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(engine.weights[k], w[k].bfloat16()) for k in w)


async def test_sequence_order_and_aborted_partials_returned() -> None:
    w, log = _trainer(), []
    engines = _fleet(w, 2, log)
    sender = WeightSender(mode="delta")
    result = await sync_weights(engines, sender, weights=w, version=1, colocated=True)
    steps = [entry.split(":")[0] for entry in log]
    order = ["pause", "abort", "sleep1", "update_full", "wake_up", "reset_prefix_cache", "resume"]
    assert [s for i, s in enumerate(steps) if s not in steps[:i]] == order
    assert result.version == 1 and all(e.version == 1 and _holds(e, w) for e in engines)
    assert [[o.request_id for o in a] for a in result.aborted] == [["req-0-0", "req-0-1"], ["req-1-0", "req-1-1"]]
    assert all(o.finish_reason == "abort" for a in result.aborted for o in a)
    assert result.metrics.num_aborted == 4 and not any(e.paused for e in engines)
    assert dict(result)["kind"] == "full" and dict(result)["bytes_sent"] == result.metrics.bytes_sent > 0

    log.clear()
    _step(w, 1)
    result = await sync_weights(engines, sender, weights=w, version=2, colocated=False)
    assert "sleep1:0" not in log and result.metrics.kind == "delta"
    assert 0 < result.metrics.changed_fraction < 0.5
    assert all(e.version == 2 and _holds(e, w) for e in engines)


async def test_engine_behind_the_base_gets_a_full_push() -> None:
    w, log = _trainer(), []
    engines = _fleet(w, 2, log)
    sender = WeightSender(mode="delta")
    await sync_weights(engines[:1], sender, weights=w, version=1, colocated=False)  # engine 1 misses v1
    _step(w, 2)
    result = await sync_weights(engines, sender, weights=w, version=2, colocated=False)
    assert result.metrics.kind == "full"
    assert all(e.version == 2 and _holds(e, w) for e in engines)


async def test_refused_delta_is_retried_once_with_a_full_update() -> None:
    w, log = _trainer(), []
    engines = _fleet(w, 2, log)
    sender = WeightSender(mode="delta")
    await sync_weights(engines, sender, weights=w, version=1, colocated=False)
    real_update = engines[1].update_weights

    async def drifts_then_updates(update: WeightUpdate) -> int:
        engines[1].version = 7  # its version moved between the check and the push
        return await real_update(update)

    engines[1].update_weights = drifts_then_updates
    log.clear()
    _step(w, 3)
    result = await sync_weights(engines, sender, weights=w, version=2, colocated=False)
    assert result.metrics.num_full_retries == 1
    assert "update_delta:1" in log and "update_full:1" in log and "update_full:0" not in log
    assert all(e.version == 2 and _holds(e, w) for e in engines)


async def test_failed_push_leaves_every_engine_on_its_previous_version() -> None:
    w, log = _trainer(), []
    engines = _fleet(w, 3, log, corrupt=None)
    sender = WeightSender(mode="delta")
    await sync_weights(engines, sender, weights=w, version=1, colocated=True)
    old = {k: v.clone() for k, v in w.items()}
    engines[1].corrupt = True
    _step(w, 4)
    with pytest.raises(SyncFailed) as info:
        await sync_weights(engines, sender, weights=w, version=2, colocated=True)
    assert info.value.engine_index == 1 and info.value.versions == [1, 1, 1]
    assert isinstance(info.value.__cause__, ChecksumError)
    assert all(e.version == 1 and _holds(e, old) for e in engines), "no engine may keep the new weights"
    assert not any(e.paused for e in engines) and log[-1].startswith("resume")
    # the sender went back too: the next sync is a delta from version 1 again
    engines[1].corrupt = False
    result = await sync_weights(engines, sender, weights=w, version=2, colocated=True)
    assert result.metrics.kind == "delta" and all(e.version == 2 and _holds(e, w) for e in engines)


class TrainerLike:
    """What the trainer actor's handle looks like to the sequence: async endpoints."""

    def __init__(self, w: dict[str, torch.Tensor], mode: str) -> None:
        self.w, self.version, self.sender = w, 0, WeightSender(mode=mode)

    async def weight_update(self) -> WeightUpdate:
        return self.sender.encode(self.w, self.version)

    async def weights_refused(self) -> None:
        self.sender.force_full()

    async def revert_update(self) -> WeightUpdate | None:
        return self.sender.revert_update()


@pytest.mark.parametrize("colocated", [False, True])
async def test_encode_runs_before_the_pause_unless_colocated(colocated: bool) -> None:
    """Without colocation the engines keep generating while the trainer
    encodes; colocated, the encode waits until sleep(1) has freed the KV cache."""
    w, log = _trainer(), []
    engines = _fleet(w, 2, log)
    trainer = TrainerLike(w, mode="delta")

    async def logged_update() -> WeightUpdate:
        log.append("encode:t")
        return trainer.sender.encode(trainer.w, trainer.version)

    trainer.weight_update = logged_update  # type: ignore[method-assign]
    for v in (1, 2):
        trainer.version = v
        _step(w, v)
        log.clear()
        result = await sync_weights(engines, trainer, colocated=colocated)
        steps = [entry.split(":")[0] for entry in log]
        first = [x for i, x in enumerate(steps) if x not in steps[:i]]
        kind = "update_full" if v == 1 else "update_delta"
        if colocated:
            assert first == ["pause", "abort", "sleep1", "encode", kind, "wake_up", "reset_prefix_cache", "resume"]
        else:
            assert first == ["encode", "pause", "abort", kind, "reset_prefix_cache", "resume"]
        assert all(e.version == v and _holds(e, w) for e in engines)
        assert 0 < result.metrics.paused_ms <= result.metrics.total_ms


async def test_actor_like_source_with_async_endpoints() -> None:
    w, log = _trainer(), []
    engines = _fleet(w, 2, log)
    trainer = TrainerLike(w, mode="delta")
    for v in (1, 2):
        trainer.version = v
        _step(w, v)
        result = await sync_weights(engines, trainer, colocated=True)
        assert result.version == v and result.metrics.kind == ("full" if v == 1 else "delta")
        assert all(e.version == v and _holds(e, w) for e in engines)
    engines[0].corrupt = True
    trainer.version = 3
    _step(w, 3)
    with pytest.raises(SyncFailed):
        await sync_weights(engines, trainer, colocated=False)
    assert [e.version for e in engines] == [2, 2]


async def test_failed_full_push_reports_the_split_it_cannot_undo() -> None:
    """A full update cannot be taken back without a second model copy: the
    error says exactly which engine holds which version."""
    w, log = _trainer(), []
    engines = _fleet(w, 2, log)
    trainer = TrainerLike(w, mode="full")
    trainer.version = 1
    await sync_weights(engines, trainer, colocated=False)
    engines[0].corrupt = True
    trainer.version = 2
    with pytest.raises(SyncFailed) as info:
        await sync_weights(engines, trainer, colocated=False)
    assert info.value.engine_index == 0 and info.value.versions == [1, 2]
    assert not any(e.paused for e in engines)


async def test_released_source_is_not_re_encoded_a_failed_push_is_reverted() -> None:
    """Once ``released`` is set the trainer may already hold newer weights: a
    push that fails is not retried from them; the engines that moved go back."""
    w, log = _trainer(), []
    engines = _fleet(w, 2, log)
    trainer = TrainerLike(w, mode="delta")
    trainer.version = 1
    released = asyncio.Event()
    await sync_weights(engines, trainer, colocated=False, released=released)
    assert released.is_set() and [e.version for e in engines] == [1, 1]

    engines[1].corrupt = True
    trainer.version = 2
    _step(w, 2)
    released = asyncio.Event()
    log.clear()
    with pytest.raises(SyncFailed) as info:
        await sync_weights(engines, trainer, colocated=False, released=released)
    assert released.is_set() and "update_full:1" not in log  # no full retry
    assert info.value.versions == [1, 1] and not any(e.paused for e in engines)


class StagingEngine(FakeEngine):
    """A FakeEngine that checks a payload ahead of the pause (``stage_weights``),
    as the torch engine does; ``fail_stage``: its check raises instead."""

    fail_stage = False

    async def stage_weights(self, update: WeightUpdate) -> bool:
        self._note("stage")
        assert not self.paused, "staged with the engine paused"
        if self.fail_stage:
            raise RuntimeError("stage broke")
        return stage_update(self.weights, update)


@pytest.mark.parametrize("fail_stage", [False, True])
async def test_a_planned_full_payload_is_checked_before_the_pause_the_apply_after_only_copies(
        fail_stage: bool, monkeypatch) -> None:
    """Published and checked while the engines still generate; with them paused
    the apply copies (no second check). A check that fails ahead is made again
    by the apply, which decides."""
    from sync import device

    w, log = _trainer(), []
    engines = [StagingEngine({k: tuple(v.shape) for k, v in w.items()}, log, i) for i in range(2)]
    engines[1].fail_stage = fail_stage
    sender = WeightSender(mode="full", device_plan="always")
    checks: list[str] = []
    real = device.ReceiverPlan.check
    monkeypatch.setattr(device.ReceiverPlan, "check", lambda self, m, r: checks.append(
        [x for x in log if x.startswith(("stage", "update"))][-1]) or real(self, m, r))
    result = await sync_weights(engines, sender, weights=w, version=1, colocated=False,
                                transport=InProcessTransport())
    steps = [entry.split(":")[0] for entry in log]
    assert [x for i, x in enumerate(steps) if x not in steps[:i]] == [
        "stage", "pause", "abort", "update_full", "reset_prefix_cache", "resume"]
    assert all(e.version == 1 and _holds(e, w) for e in engines)
    # engine 0: checked at its stage only; engine 1 (its stage raised before checking): at its update
    assert checks == (["stage:0", "update_full:1"] if fail_stage else ["stage:0", "stage:1"])
    assert result.metrics.stage_ms > 0 and result.metrics.device_plan


async def test_nothing_is_staged_over_a_transport_that_cannot_publish_ahead() -> None:
    w, log = _trainer(), []
    engines = [StagingEngine({k: tuple(v.shape) for k, v in w.items()}, log, i) for i in range(2)]

    class Collective(InProcessTransport):
        can_stage = False  # as a broadcast: the engines receive in step with the send

    result = await sync_weights(engines, WeightSender(mode="full", device_plan="always"), weights=w, version=1,
                                colocated=False, transport=Collective())
    assert not any(x.startswith("stage") for x in log) and result.metrics.stage_ms == 0
    assert all(e.version == 1 and _holds(e, w) for e in engines)


class _Rounds:
    """An engine seen from the driver: counts the calls that cross to it."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name: str):
        attr = getattr(self.engine, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return call

    async def get_version(self) -> int:
        self.calls.append("get_version")
        return self.engine.version


async def test_a_push_costs_each_engine_at_most_two_control_rounds() -> None:
    """The driver orders and compares versions; each engine runs its own swap.
    The first push asks each engine its version; later ones know it from the
    last swap. A planned full payload is checked ahead (round 1), then swapped (round 2)."""
    w, log = _trainer(), []
    engines = [_Rounds(StagingEngine({k: tuple(v.shape) for k, v in w.items()}, log, i)) for i in range(2)]
    sender = WeightSender(mode="full", device_plan="always")
    for version in (1, 2, 3):
        for e in engines:
            e.calls.clear()
        _step(w, version)
        await sync_weights(engines, sender, weights=w, version=version, colocated=False,
                           transport=InProcessTransport())
        first = ["get_version"] if version == 1 else []
        assert all(e.calls == first + ["stage_weights", "swap_weights"] for e in engines), [e.calls for e in engines]
        assert all(e.engine.version == version and _holds(e.engine, w) for e in engines)
