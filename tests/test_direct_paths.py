"""The driver carries control only: every sample goes rollout actor →
TransferQueue → trainer actor and every weight payload trainer → engines.

A probe (``tests/driver_probe.py``) hooks the driver's serialization
boundaries: the ``process`` runtime's pipe codec and its spawn, the
TransferQueue's socket frames, Ray's serialize / deserialize of every
``.remote()`` argument and every result the driver takes, and the ``local``
runtime's in-process calls. It sees each message as objects and as bytes on the
wire and measures the bytes inside it by kind: payload (Samples, queue rows,
token lists, tensors, update buckets, raw buffers, many small chunks together)
and control (numbers, short number lists, strings as values and as names,
small chunks, a weight manifest, a group request's prompt).

Each real run is a short fully-async run (first sync full, then deltas): the
payload bytes through the driver, at setup and while training, must be zero
while control messages flow (their count is checked, so the probe cannot pass
by seeing nothing), and while training the control bytes, endpoint by endpoint
and kind by kind, must stay within what ``tests/control_budget.py`` allows the
same messages: what control messages must carry, sized by the run's config and
model. The negative controls show the check fails when payload does cross:
samples and a weight update routed through the driver on purpose after the
training (``process`` and ``ray`` runtimes), a trainer that returns its update
in-band instead of publishing it (``local``), and rollout actors that hide 8
token ids in each group report, as a list and as a string
(``tests/report_leaks.py``; ``process`` and ``ray``), each found where it
crossed. A run whose reward raises (error messages naming a file:line, drop
reasons) stays within the budget. Unit checks show each shape counts by its
bytes and kind, and the budget of a group report leaves no room for 8 ids.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import json
import pathlib
import pickle
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import loop
from actors.launch import launch
from contracts.rollout import GroupReport, GroupRequest, RolloutCounts
from contracts.sample import Sample
from contracts.training import BatchRequest, StepReport
from contracts.weights import Manifest, TensorEntry, WeightUpdate
from sync.encode import WeightSender
from sync.link import BroadcastPush
from tests import report_leaks
from tests.control_budget import ERROR_MESSAGE_BYTES, ControlBudget, Limits, endpoint, per_step
from tests.driver_probe import (BUFFER, MANIFEST, NAME, NUMBER, PROMPT, SAMPLE, SHORT_LIST, SMALL_BYTES,
                                SMALL_CHUNKS_MAX_CONTROL, TEXT, TOKEN_LIST_MAX_CONTROL, WEIGHT, DriverProbe, Seen,
                                install, measure, payload, payload_bytes)
from transfer_queue import rpc
from transfer_queue.codec import encode_new_rows
from transfer_queue.served import ServedDeployment

ROOT = pathlib.Path(__file__).resolve().parents[1]
# run.log_samples_every=0: the few samples a step shows in samples.jsonl ride its report through the
# driver on purpose (run.log_samples of them every N steps); every other sample byte must not
SHORT = ["trainer.batch_prompts=2", "rollout.n=4", "run.progress=false", "rollout.max_response_tokens=8",
         "sync.mode=delta", "run.log_samples_every=0"]
STEPS = 3  # each run's trainer steps


# ------------------------------------------------------------ the probe itself
@dataclasses.dataclass
class _Holder:
    tokens: np.ndarray


class _WithDict:
    def __init__(self, inner: Any) -> None:
        self.inner = inner


class _WithSlots:
    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner


class _Carrier(msgspec.Struct):
    body: Any


def _sample(uid: str = "a", num_tokens: int = 8) -> Sample:
    return Sample(uid=uid, group_id="g", prompt_ids=[1, 2, 3], response_ids=[4] * num_tokens,
                  rollout_logprobs=[-0.5] * num_tokens, token_versions=[0] * num_tokens, reward=1.0)


def _manifest(num_buckets: int) -> Manifest:
    entry = TensorEntry(name="w", dtype="float32", shape=(64, 64), start=0, count=4096, encoding="raw",
                        num_changed=4096, bucket=0, offset=0, nbytes=16384, checksum=(1, 2))
    return Manifest(version=3, base_version=None, kind="full", entries=[entry] * num_buckets,
                    bucket_sizes=[16384] * num_buckets, num_elements=4096 * num_buckets, num_changed=0)


PAYLOADS: dict[str, tuple[Any, str, int]] = {  # message, the kind it is, its bytes
    "sample": (_sample(num_tokens=8), SAMPLE, 8 * (3 + 8 + 8 + 8)),
    "queue row": ({"uid": "a", "group_id": "g", "response_ids": [4, 5]}, SAMPLE, 1 + 16),
    "tensor": ((1, "m", torch.zeros(4)), WEIGHT, 16),
    "ndarray": (np.zeros(100, np.uint8), BUFFER, 100),
    "bytes": (b"x" * 100, BUFFER, 100),
    "bytearray": (bytearray(100), BUFFER, 100),
    "memoryview": (memoryview(np.zeros(50, np.int16)), BUFFER, 100),
    "array.array": (array.array("i", range(25)), BUFFER, 100),
    "PickleBuffer": (pickle.PickleBuffer(b"x" * 100), BUFFER, 100),
    "PickleBuffer in a call (rpc.oob)": (("put", 3, rpc.oob(bytearray(1000))), BUFFER, 1000),
    "token-id list": ([7] * (TOKEN_LIST_MAX_CONTROL + 1), SAMPLE, 8 * (TOKEN_LIST_MAX_CONTROL + 1)),
    "token-id tuple": (tuple(range(100)), SAMPLE, 800),
    "log-prob list": ([-0.5] * 32, SAMPLE, 256),
    "nested containers": ({"a": [({"b": {np.zeros(10, np.uint8).tobytes() * 10}},)]}, BUFFER, 100),
    "dataclass holding an ndarray": (_Holder(np.zeros(8, np.int32)), BUFFER, 32),
    "msgspec Struct holding bytes": (_Carrier(b"y" * 65), BUFFER, 65),
    "object with __dict__ holding a tensor": (_WithDict(torch.zeros(2, 2)), WEIGHT, 16),
    "object with __slots__ holding a PickleBuffer": (_WithSlots(pickle.PickleBuffer(b"z" * 80)), BUFFER, 80),
    "100 chunks of 40 bytes": ([bytes([i]) * 40 for i in range(100)], BUFFER, 4000),
    "100 chunks of 40 bytes in a dict": ({i: bytes([i]) * 40 for i in range(100)}, BUFFER, 4000),
    "weight update with its buckets": (
        WeightUpdate(manifest=_manifest(2), buckets=[bytes(200), np.zeros(50, np.uint8)]), WEIGHT, 250),
    "PickleBuffer bucket of a weight update": (WeightUpdate(manifest=_manifest(1), buckets=[rpc.oob(bytes(300))]),
                                               WEIGHT, 300),
}


@pytest.mark.parametrize("name", PAYLOADS)
def test_the_probe_counts_every_payload_shape_by_its_bytes_and_kind(name: str) -> None:
    message, kind, nbytes = PAYLOADS[name]
    assert payload(message) == Counter({kind: nbytes})


CONTROL: dict[str, Any] = {
    "counters": {"step": 3, "reward": 0.5, "dropped": {"stale": 2}},
    "a short id list": list(range(TOKEN_LIST_MAX_CONTROL)),
    "a numpy scalar": {"loss": np.float32(0.25)},
    "a group request (its prompt is the request)": GroupRequest(group_id="g", prompt_ids=list(range(200)), n=8),
    "a group report": GroupReport(group_id="g", num_samples=8, num_queued=7, dropped={"error": 1}),
    "a batch request": BatchRequest(batch_size=8, group_size=4, current_version=2, max_staleness=1),
    "a step report": StepReport(version=3, num_samples=8, num_tokens=64, wait_s=0.1, train_s=0.2,
                                metrics={f"m{i}": float(i) for i in range(40)}),
    "a published update: manifest, no buckets": WeightUpdate(manifest=_manifest(40), buckets=[]),
    "a broadcast push": BroadcastPush(version=3),
    "the queue client (its 32-byte secret)": ServedDeployment(("127.0.0.1", 1), bytes(32)),
    "one auth token": (b"t" * 64,),
    "a few digests": [bytes([i]) * 32 for i in range(SMALL_CHUNKS_MAX_CONTROL // 32)],
    "an error": RuntimeError("out of memory"),
    "a call": (7, "train_step", (BatchRequest(batch_size=8, group_size=4, current_version=2),), {}),
}


@pytest.mark.parametrize("name", CONTROL)
def test_the_probe_counts_zero_for_control_messages(name: str) -> None:
    assert payload_bytes(CONTROL[name]) == 0


def test_a_shared_buffer_counts_once_as_pickle_writes_it_once() -> None:
    buf = np.zeros(100, np.uint8)
    assert payload_bytes([buf, buf, {"again": buf}]) == 100


_REPORT = GroupReport(group_id="g12", num_samples=4, num_queued=4, counts=RolloutCounts(generated=8, queued=8))
KINDS: dict[str, tuple[Any, dict[str, int]]] = {  # a control message, its bytes by kind
    "a number": (7, {NUMBER: 8}),
    "a bool": (True, {NUMBER: 8}),
    "a numpy scalar": (np.float32(0.5), {NUMBER: 8}),
    "a short list": ([5, 12, 7, 3, 18, 2, 9, 11], {SHORT_LIST: 64}),
    "a short tuple of floats": ((0.5, 0.25), {SHORT_LIST: 16}),
    "a string": ("g12", {TEXT: 3}),
    "a string, in UTF-8": ("é", {TEXT: 2}),
    "a dict": ({"loss": 0.5}, {NAME: 4, NUMBER: 8}),
    "a list of numbers and a string": ([5, 12, "x"], {NUMBER: 16, TEXT: 1}),
    "a set of numbers": ({5, 12}, {NUMBER: 16}),
    "nested containers": ({"a": [("bc", 1)]}, {NAME: 1, TEXT: 2, NUMBER: 8}),
    "a small chunk": (bytes(32), {SMALL_BYTES: 32}),
    "an error": (RuntimeError("out of memory"), {TEXT: 13}),
    "a group report (a Struct)": (_REPORT, {TEXT: 3, NUMBER: (6 + 4) * 8}),  # its 6 numbers, its counts' 4
    "a group request: its prompt and meta": (GroupRequest(group_id="g1", prompt_ids=list(range(200)), n=8,
                                                          meta={"answer": "42"}), {TEXT: 2, NUMBER: 8, PROMPT: 1608}),
    # its entry: name, dtype, shape, 6 sizes, encoding, checksum; its own 5 numbers, kind, bucket sizes
    "a manifest": (WeightUpdate(manifest=_manifest(1), buckets=[]),
                   {MANIFEST: (1 + 7 + 2 * 8 + 6 * 8 + 3 + 2 * 8) + (5 * 8 + 4 + 1 * 8)}),
    "None and empty containers": ((None, [], {}, ""), {}),
}


@pytest.mark.parametrize("name", KINDS)
def test_the_probe_counts_every_control_shape_by_its_bytes_and_kind(name: str) -> None:
    message, expected = KINDS[name]
    assert measure(message) == Counter(expected)


@pytest.fixture(scope="module")
def limits() -> Limits:
    """The budget's sizes for the runs below (SHORT on fully_async.yaml)."""
    from actors.config import load_config

    cfg = load_config(ROOT / "fully_async.yaml", SHORT)
    return Limits.of(cfg, ROOT / cfg.model.path)


def _room(budget: ControlBudget, where: str, message: Any) -> Counter[str]:
    """What the budget allows ``message`` beyond what it carries, by kind."""
    allowed, carried = budget(where, message), measure(message)
    return Counter({k: allowed[k] - carried[k] for k in set(allowed) | set(carried)})


def test_a_group_reports_budget_leaves_no_room_for_eight_ids(limits: Limits) -> None:
    """A report of a whole group queued (the common one) fills its budget but for
    the room a group id of the run's longest leaves: less than 8 ids as a string
    ("1 2 3 4 5 6 7 8", 15 bytes) and no list at all."""
    room = _room(ControlBudget(limits), "process:rollout-0.generate_group (received)", _REPORT)
    assert room == Counter({TEXT: limits.group_id_bytes - len("g12")}), room
    assert room[TEXT] < len("1 2 3 4 5 6 7 8")


def test_a_group_report_that_counts_a_reward_error_may_carry_its_message(limits: Limits) -> None:
    """Drop reasons and an error message are allowed exactly where the report counts
    them: the reasons of a dropped group, the reward error naming a file:line."""
    budget = ControlBudget(limits)
    error = f"ValueError: no number in 'seven' ({ROOT / 'examples' / 'rewards' / 'arithmetic.py'}:42)"
    failed = msgspec.structs.replace(_REPORT, num_queued=0, num_reward_errors=1, reward_error=error,
                                     dropped={"reward_error": 1, "group_incomplete": 3})
    room = _room(budget, "ray:RolloutActor.generate_group (received)", failed)
    assert min(room.values()) >= 0 and room[TEXT] == ERROR_MESSAGE_BYTES + limits.group_id_bytes - len(error) - 3
    assert budget("process:rollout-0.generate_group (received)", _REPORT)[NAME] == 0  # nothing dropped: no reasons


def test_an_endpoint_without_a_budget_is_allowed_nothing(limits: Limits) -> None:
    assert endpoint("ray:TrainerActor.train_step (sent)") == endpoint("local:trainer.train_step (sent)")
    assert endpoint("queue:call.statistics (received)") == "queue.statistics (received)"
    assert ControlBudget(limits)("process:rollout-0.samples (received)", ["g1"]) == Counter()


# ------------------------------------------------------------- real runs
@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> DriverProbe:
    return install(monkeypatch)


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@dataclasses.dataclass
class _Outcome:
    run: Any
    setup: Seen  # what crossed the driver while launch() spawned and wired the actors
    training: Seen  # what crossed it while it trained
    routed: Seen | None  # what crossed it while ``route`` ran, after training
    route_result: Any  # what ``route`` returned


def _run(probe: DriverProbe, tmp_path: pathlib.Path, *overrides: str,
         route: Callable[[Any], Awaitable[Any]] | None = None) -> _Outcome:
    """A short fully-async run (3 steps: the first sync full, then deltas) and,
    when given, ``route(run)`` on the driver's loop after its training."""
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"run.output_dir={tmp_path}", *overrides)
    with run:
        probe.budget = ControlBudget(Limits.of_run(run))
        setup = probe.snapshot()
        run.train(steps=STEPS)
        trained = probe.snapshot()
        routed = result = None
        if route is not None:
            result = loop.run(route(run))
            routed = probe.snapshot() - trained
    kinds = [m["sync/kind"] for m in run.history]
    assert kinds[0] == "full" and kinds[1:] == ["delta", "delta"], kinds
    assert run.history[-1]["trained"] == STEPS * 2 * 4
    return _Outcome(run, setup, trained - setup, routed, result)


def _assert_control_only(seen: Seen, steps: int = STEPS) -> None:
    """The check of every real run: messages flowed, none carried payload, and
    the control they carried stayed within its budget where it crossed."""
    assert seen.messages, "the probe saw no driver message: it is not wired"
    assert not seen.payload, f"payload through the driver: {dict(seen.payload)}"
    over = seen.over_budget()
    assert not over, "control through the driver over its budget, bytes per step: " + "; ".join(
        f"{where} {kind} {n / steps:.1f} > {allowed / steps:.1f}" for (where, kind), (n, allowed) in over.items()
    ) + " (all endpoints: " + ", ".join(f"{k} {n:.1f} of {a:.1f}" for k, (n, a) in per_step(seen, steps).items()) + ")"


def _assert_run_carried_control_only(out: _Outcome) -> None:
    """Training within the budget; setup (the actors' constructors: configs, the
    queue client) without payload, its control unbudgeted: it happens once."""
    _assert_control_only(out.training)
    assert not out.setup.payload, f"payload through the driver at setup: {dict(out.setup.payload)}"


ROUTED_SAMPLES = 4


async def _route_payload_through_the_driver(run: Any) -> dict[str, int]:
    """What the design forbids, done on purpose from the driver: samples into the
    queue and back out through its client, the trainer's weights to the driver
    and on to an engine as an in-band update (buckets as PickleBuffers).
    Returns the bytes of the weights and of the update's buckets."""
    samples = [_sample(f"routed-{i}") for i in range(ROUTED_SAMPLES)]
    await run.queue.put(samples, partition="routed")
    batch = await run.queue.get("driver", ROUTED_SAMPLES, partition="routed", timeout_s=30)
    assert sorted(s.uid for s in batch.samples) == sorted(s.uid for s in samples)
    await run.queue.ack(batch.batch_id)

    trainer, rollout = run.policy.trainer, run.policy.rollouts[0]
    weights, _ = await trainer.local_weights("float32")
    update = WeightSender(mode="full", dtype=torch.float32).encode(weights, await rollout.get_version())
    in_band = WeightUpdate(manifest=update.manifest, buckets=[rpc.oob(b.numpy()) for b in update.buckets])
    assert await rollout.update_weights(in_band) == update.manifest.version
    return {"weights": sum(t.numel() * t.element_size() for t in weights.values()),
            "buckets": update.manifest.payload_bytes}


@pytest.fixture(scope="module")
def process_run(tmp_path_factory: pytest.TempPathFactory) -> _Outcome:
    """One run under the ``process`` runtime with the queue served from its own
    process, shared by the positive check and the negative control (which routes
    payload after the training, counted apart): one run instead of two."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _run(install(monkeypatch), tmp_path_factory.mktemp("process"), "runtime.type=process",
                    "transfer_queue.deployment=local", route=_route_payload_through_the_driver)


def test_process_runtime_driver_carries_control_only(process_run: _Outcome) -> None:
    out = process_run
    _assert_run_carried_control_only(out)
    assert out.run.weight_transport == "broadcast"  # CPU processes: a gloo broadcast from the trainer
    assert out.training.messages["process:trainer.train_step (sent)"] == 3
    assert out.training.messages["process:trainer.train_step (received)"] == 3
    assert out.training.messages["process:rollout-0.swap_weights (sent)"] == 3  # a BroadcastPush each: control
    assert out.training.messages["queue:call.statistics (received)"] > 0  # the queue's counters
    assert out.training.wire_bytes["pipe"] > 0 and out.training.wire_bytes["socket"] > 0


def test_payload_routed_through_the_driver_is_found_where_it_crossed(process_run: _Outcome) -> None:
    """The negative control: a sample and a weight bucket through the driver on
    purpose, after the run of the test above. The probe finds each where it
    crossed, so the check every real run makes fails."""
    routed, sent = process_run.routed, process_run.route_result
    assert routed is not None
    with pytest.raises(AssertionError, match="payload through the driver"):
        _assert_control_only(routed)
    samples = routed.bytes_of(SAMPLE)
    sample_bytes = ROUTED_SAMPLES * payload_bytes(_sample())
    # the put's rows: new samples travel as one msgpack body (a raw buffer here), every byte of it
    body, _, _ = encode_new_rows([_sample(f"routed-{i}") for i in range(ROUTED_SAMPLES)])
    assert routed.bytes_of(BUFFER) == {"queue:put_new (sent)": len(body)}, "every other payload was named"
    assert samples.get("queue:read (received)", 0) >= sample_bytes, samples  # the get's rows
    weights = routed.bytes_of(WEIGHT)
    assert weights.get("process:trainer.local_weights (received)") == sent["weights"] > 0, weights
    assert weights.get("process:rollout-0.update_weights (sent)") == sent["buckets"] > 0, weights


@pytest.mark.ray
@pytest.mark.parametrize("deployment", ["local", "ray"])
def test_ray_runtime_driver_carries_control_only(deployment: str, probe: DriverProbe, tmp_path: pathlib.Path,
                                                 ray_cluster: Any) -> None:
    out = _run(probe, tmp_path, "runtime.type=ray", f"transfer_queue.deployment={deployment}",
               route=_route_payload_through_the_driver)
    _assert_run_carried_control_only(out)
    assert out.run.weight_transport == "broadcast"
    assert out.training.messages["ray:RolloutActor.generate_group (sent)"] > 0
    assert out.training.messages["ray:RolloutActor.generate_group (received)"] > 0
    assert out.training.wire_bytes["ray"] > 0 and out.training.wire_bytes["socket"] > 0
    # and its negative control: payload routed on purpose is found where it crossed (new
    # samples travel as one msgpack body, the ray queue's reads as msgpack too: raw buffers here)
    routed, sent = out.routed, out.route_result
    assert routed is not None
    assert "queue:put_new (sent)" in routed.bytes_of(BUFFER)
    rows = routed.bytes_of(BUFFER if deployment == "ray" else SAMPLE)
    assert ("queue:get (received)" if deployment == "ray" else "queue:read (received)") in rows, rows
    weights = routed.bytes_of(WEIGHT)
    assert weights.get("ray:TrainerActor.local_weights (received)") == sent["weights"] > 0, weights
    assert weights.get("ray:RolloutActor.update_weights (sent)") == sent["buckets"] > 0, weights


def test_local_runtime_policy_never_holds_a_sample_or_a_weight_tensor(probe: DriverProbe, tmp_path: pathlib.Path,
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
    out = _run(probe, tmp_path, "runtime.type=local")
    _assert_run_carried_control_only(out)
    assert out.run.weight_transport == "inproc"
    assert set(queue_calls) <= {"statistics_async", "close"}, queue_calls
    assert out.training.messages["local:trainer.weight_update (received)"] > 0


def test_a_trainer_that_hands_the_driver_its_update_in_band_fails_the_check(
        probe: DriverProbe, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A regression in the code, not a call from the test: the trainer's update is
    returned as it is instead of published on the weight link. The run still
    trains (the engines apply what they get), and the probe finds the buckets
    on both legs of their trip through the policy."""
    from actors.trainer import TrainerActor

    def in_band(self: Any) -> WeightUpdate:
        return self.sender.encode(self.backend.named_weights(), self.backend.version)

    monkeypatch.setattr(TrainerActor, "_weight_update", in_band)
    out = _run(probe, tmp_path, "runtime.type=local")
    with pytest.raises(AssertionError, match="payload through the driver"):
        _assert_control_only(out.training)
    weights = out.training.bytes_of(WEIGHT)
    assert weights.keys() == {"local:trainer.weight_update (received)", "local:rollout-0.swap_weights (sent)"}
    assert weights["local:trainer.weight_update (received)"] == weights["local:rollout-0.swap_weights (sent)"] > 0


LEAKS = {"as a list": (report_leaks.IdsAsList, SHORT_LIST), "as a string": (report_leaks.IdsAsText, TEXT)}


@pytest.mark.parametrize("runtime", ["process", pytest.param("ray", marks=pytest.mark.ray)])
@pytest.mark.parametrize("leak", LEAKS)
def test_token_ids_hidden_in_group_reports_fail_the_check(leak: str, runtime: str, probe: DriverProbe,
                                                         tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                         request: pytest.FixtureRequest) -> None:
    """A regression in the actor, not a call from the test: each group report
    carries 8 of its responses' token ids, as a list field of their own or as a
    string in its error field, from the actor's own process. The check fails,
    on that endpoint and kind only (the run trains as before)."""
    import actors.wiring

    actor, kind = LEAKS[leak]
    if runtime == "ray":
        request.getfixturevalue("ray_cluster")
    monkeypatch.setattr(actors.wiring, "RolloutActor", actor)  # the class the composition root spawns
    out = _run(probe, tmp_path, f"runtime.type={runtime}", "transfer_queue.deployment=local")
    with pytest.raises(AssertionError, match="over its budget"):
        _assert_run_carried_control_only(out)
    over = out.training.over_budget()
    assert {(endpoint(where), k) for where, k in over} == {("generate_group (received)", kind)}, over
    ((where, _), (carried, _)), = over.items()
    if kind == SHORT_LIST:  # the only short lists there: every report's ids, all found
        assert carried == out.training.messages[where] * 8 * report_leaks.LEAKED_IDS


_failures = itertools.count()


def reward_that_fails_now_and_then(text: str, answer: str) -> float:
    """A user reward (``task.kwargs.reward=tests.test_direct_paths:reward_that_fails_now_and_then``)
    that raises on every fifth call, with a message quoting the response."""
    if next(_failures) % 5 == 4:
        raise ValueError(f"cannot score {text!r} against the answer {answer!r}")
    return float(text.strip() == answer.strip())


def test_a_run_whose_reward_raises_stays_within_the_budget(probe: DriverProbe, tmp_path: pathlib.Path,
                                                           limits: Limits) -> None:
    """Control as it is when things go wrong: groups dropped (reasons counted in
    the reports and the step reports), error messages naming the reward's file and
    line, all within the budget."""
    data = tmp_path / "digits.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(d), "answer": " ".join(reversed(d))}) + "\n"
                            for d in ("89", "123", "4567", "302")))
    out = _run(probe, tmp_path, "runtime.type=local", "task.type=text_dataset", f"task.kwargs.path={data}",
               "task.kwargs.chat_template=false",
               "task.kwargs.reward=tests.test_direct_paths:reward_that_fails_now_and_then")
    _assert_run_carried_control_only(out)
    assert out.run.history[-1]["dropped"].get("reward_error", 0) > 0, out.run.history[-1]
    reports = "local:rollout-0.generate_group (received)"
    assert out.training.bytes_of(TEXT)[reports] > out.training.messages[reports] * limits.group_id_bytes, \
        "no error message crossed: the reports' text is no more than their group ids"


def test_a_failed_train_step_hands_its_batch_back_to_the_queue(tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer acks only after its step; a step that raises nacks, so none
    of the batch's samples is lost or left leased."""
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
