"""The driver's control budget: what each control message may carry, kind by
kind, so what a training step may carry through the driver.

Each message the probe (``tests/driver_probe.py``) sees is allowed the bytes of
the largest message its endpoint (a method and a direction, whatever the actor
and the runtime: ``generate_group (received)``) can legitimately carry: its
type built with maximal realistic contents and measured by the probe's own walk,
so an allowance and what it bounds are counted alike. The sizes come from the
run (:class:`Limits`: its config and its model) or, where nothing in the config
bounds them, from a constant below that says what it is. What a message carries
only in some cases is allowed only in those cases, read from the message's own
counts: drop reasons when it counts dropped samples, an error message when it
counts a reward error. An endpoint with no entry here is allowed nothing.

A step's budget is the sum of its messages' allowances, and the check
(``Seen.over_budget``) is per endpoint and kind, so room left at one endpoint
(a step report's metric names) cannot hide a leak at another (a string in a
group report): 8 token ids as a string in each group report of the tests'
runs bring the driver's text to 113 bytes a step, under the 135 all its
messages are allowed, but the group reports' to 52, over their 16.

Room a budget leaves, where it is maximal rather than exact: a group id of the
run's longest (4 bytes of text a report in the tests' runs); all 8 drop
reasons in a report or step report that counts any; METRICS names; a prompt's
meta; a manifest's optional fields. A leak shaped as that content and within
that room passes; a number list, a string or a dict where the message has
none, or more numbers than its fields, does not. Setup (the actors'
constructors: configs, the queue client) happens once and is checked for
payload only. What the endpoints of a training step may carry:

    endpoint                   message       allowance (kinds: tests/driver_probe.py)
    generate_group (sent)      GroupRequest  text: a group id; number: n; prompt: max_model_len token ids
                                             and PROMPT_META_BYTES of meta
    generate_group (received)  GroupReport   text: a group id, and an error message (ERROR_MESSAGE_BYTES)
                                             if it counts a reward error; number: its counts, and one
                                             per drop reason (name: the reason) in each of its drop
                                             counts that is not empty
    train_step (sent)          BatchRequest  text: the consumer's name, a group id per group of a batch;
                                             number: its 5 sizes and versions
    train_step (received)      StepReport    number: its 5 figures, one per metric (at most METRICS)
                                             and per drop reason if it counts drops; name: theirs
    weight_update (received)   WeightUpdate  manifest: an entry per tensor of the model and per bucket
                                             of a full push (a tensor split between two), each with
                                             every optional field set
    swap_weights (sent)        the push      number: a version (a broadcast), or manifest: the update
                                             (when one crossed: in-process); text: the in-flight mode;
                                             number: asleep
    swap_weights (received)    SwapReport    number: 4
    weight_link (received)     the link      text: its kind and backend; number: its world size
    get_version, broadcast_pending (received)  number: 1
    queue.statistics (sent)    the call      text: its method's name
    queue.statistics (received)  QueueStats  number: its 8 counters, one per partition's 3 and
                                             consumer's 4 counters (at most QUEUE_NAMES each), one per
                                             drop reason if it counts drops; name: theirs
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from contracts.rollout import GroupReport, GroupRequest, RolloutCounts, SwapReport
from contracts.training import BatchRequest, StepReport
from contracts.weights import Manifest, ShardSpec, TensorEntry, WeightUpdate
from sync.link import BroadcastPush
from tests.driver_probe import Seen, measure
from transfer_queue.wire import ConsumerStats, PartitionStats, QueueStats

__all__ = ["ControlBudget", "Limits", "endpoint", "per_step"]

# Every reason a sample is dropped for, by whoever counts it: the rollout actor
# (reward_error, reward_timeout, aborted, group_incomplete), the policy (actor_died),
# the queue (stale, stale_group, storage_lost). A drop count holds some of them.
DROP_REASONS = ("reward_error", "reward_timeout", "aborted", "group_incomplete", "actor_died", "stale",
                "stale_group", "storage_lost")
# A reward error as the rollout actor reports it: "Type: message (file:line)" -- an
# exception's name, its message and where the user's reward raised (a path of a
# couple of hundred bytes at most). Nothing cuts it shorter on the way.
ERROR_MESSAGE_BYTES = 1024
# A prompt's meta is what the task attached to it for its reward (an answer, a
# reference solution); nothing in the config bounds it.
PROMPT_META_BYTES = 1024
# The trainer's step metrics: the batch's statistics and the backend's figures
# (18 for the torch backend on CPU), each name like "train/zero_adv_group_share".
METRICS, METRIC_NAME_BYTES = 64, 48
QUEUE_NAMES, QUEUE_NAME_BYTES = 8, 32  # partitions and consumers of the queue, by name ("train", "trainer")
TRANSPORT_NAME_BYTES = 16  # a weight link's kind or backend ("broadcast", "gloo")
IN_FLIGHT_BYTES = len("recompute")  # the longest of sync.in_flight's modes
LAYOUT_BYTES = 32  # a manifest's layout digest (sync.device.layout_digest)
_BYTES_PER_ELEMENT = 4  # a full push's element at its widest (float32)
# Group ids are "g<n>", n counting the groups a run requested: its steps' groups, with
# this many to spare for the groups dropped, evaluated or in flight.
_GROUPS_PER_TRAINED_GROUP = 10


@dataclasses.dataclass(frozen=True)
class Limits:
    """The sizes a run's control messages may reach, from its config and model."""

    group_id_bytes: int  # the longest group id it may issue
    groups_per_batch: int  # the group ids a batch request names
    prompt_tokens: int  # rollout.engine.max_model_len: a prompt and its response fit it
    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # the model's (name, shape)
    num_buckets: int  # the buckets of a full push at sync.bucket_bytes

    @classmethod
    def of_run(cls, run: Any) -> Limits:
        return cls.of(run.cfg, run.model_path)

    @classmethod
    def of(cls, cfg: Any, model_path: str | pathlib.Path) -> Limits:
        """The limits of a run of ``cfg`` (a resolved Config) on the checkpoint at ``model_path``."""
        groups_per_batch = cfg.trainer.batch_prompts * cfg.policy.require_batches
        most_groups = cfg.run.total_steps * groups_per_batch * _GROUPS_PER_TRAINED_GROUP
        tensors = _model_tensors(pathlib.Path(model_path))
        full_bytes = sum(math.prod(shape) for _, shape in tensors) * _BYTES_PER_ELEMENT
        return cls(group_id_bytes=len(f"g{most_groups}"), groups_per_batch=groups_per_batch,
                   prompt_tokens=cfg.rollout.engine.max_model_len, tensors=tensors,
                   num_buckets=max(1, math.ceil(full_bytes / cfg.sync.bucket_bytes)))


def _model_tensors(model_dir: pathlib.Path) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each tensor of a safetensors checkpoint: (name, shape)."""
    from safetensors import safe_open

    out = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.extend((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
    if not out:
        raise ValueError(f"{model_dir}: no *.safetensors file to size a weight manifest by")
    return tuple(out)


_WHERE = re.compile(r"^(?:(?:local|process|ray):[^.]+\.|queue:(?:call\.)?)(?P<method>\S+) \((?P<way>sent|received)\)$")


def endpoint(where: str) -> str:
    """``process:rollout-0.generate_group (sent)`` -> ``generate_group (sent)``, whatever
    the runtime and actor; the queue's calls as ``queue.statistics (sent)``."""
    m = _WHERE.match(where)
    if m is None:
        return where
    return f"{'queue.' if where.startswith('queue:') else ''}{m['method']} ({m['way']})"


class ControlBudget:
    """What a message may carry where it crossed (module docstring): a probe's
    ``budget``, called with each message as it crosses."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def __call__(self, where: str, message: Any) -> Counter[str]:
        build = _ALLOWANCES.get(endpoint(where))
        return measure(build(self.limits, message)) if build is not None else Counter()


def per_step(seen: Seen, steps: int) -> dict[str, tuple[float, float]]:
    """Control bytes per step through the driver, summed by kind: kind -> (seen, allowed)."""
    kinds = sorted({k for _, k in seen.control} | {k for _, k in seen.allowed})
    return {k: (sum(n for (_, kk), n in seen.control.items() if kk == k) / steps,
                sum(n for (_, kk), n in seen.allowed.items() if kk == k) / steps) for k in kinds}


# -- maximal messages ---------------------------------------------------------------------------------
# Each builds afresh what it allows (the probe counts an object shared within a message once).


def _text(nbytes: int, i: int = 0) -> str:
    """A string of ``nbytes`` bytes, distinct for each ``i``."""
    return f"{i:0{nbytes}d}"[-nbytes:] if nbytes else ""


def _reasons(counted: Any) -> dict[str, int]:
    """Every drop reason, if ``counted`` (a drop count) holds any."""
    return dict.fromkeys(DROP_REASONS, 0) if counted else {}


def _call(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def _group_request(lim: Limits, seen: Any) -> Any:
    request = GroupRequest(group_id=_text(lim.group_id_bytes), prompt_ids=[0] * lim.prompt_tokens, n=0,
                           meta={"": _text(PROMPT_META_BYTES)})
    return _call(request)


def _group_report(lim: Limits, seen: Any) -> GroupReport:
    drops = getattr(seen, "num_samples", 0) > getattr(seen, "num_queued", 0)
    counts = getattr(seen, "counts", None)
    actor_drops = counts is not None and getattr(counts, "generated", 0) > getattr(counts, "queued", 0)
    error = _text(ERROR_MESSAGE_BYTES) if getattr(seen, "num_reward_errors", 0) else None
    return GroupReport(group_id=_text(lim.group_id_bytes), num_samples=0, num_queued=0, num_resumed=0,
                       dropped=_reasons(drops), counts=RolloutCounts(dropped=_reasons(actor_drops)),
                       num_scored=0, num_reward_errors=0, reward_error=error, min_version=0)


def _batch_request(lim: Limits, seen: Any) -> Any:
    group_ids = [_text(lim.group_id_bytes, i) for i in range(lim.groups_per_batch)]
    return _call(BatchRequest(consumer=_text(QUEUE_NAME_BYTES), batch_size=0, group_size=0, current_version=0,
                              max_staleness=0, group_ids=group_ids))


def _step_report(lim: Limits, seen: Any) -> StepReport:
    metrics = {_text(METRIC_NAME_BYTES, i): 0.0 for i in range(min(len(getattr(seen, "metrics", {})), METRICS))}
    return StepReport(version=0, num_samples=0, num_tokens=0, wait_s=0.0, train_s=0.0,
                      dropped=_reasons(getattr(seen, "dropped", None)), metrics=metrics)


def _manifest(lim: Limits) -> Manifest:
    """A delta push of this model as large as one can be: every optional field set."""

    def entry(name: str, shape: tuple[int, ...]) -> TensorEntry:
        shard = ShardSpec(full_shape=tuple(list(shape)), length=shape[0]) if shape else None
        return TensorEntry(name=name, dtype="bfloat16", shape=tuple(list(shape)), shard=shard, start=0, count=0,
                           encoding="sparse", index_codec="bitmask", value_codec="diff8", num_changed=0, bucket=0,
                           offset=0, nbytes=0, parts=tuple([0, 0, 0]), checksum=tuple([0, 0]),
                           base_checksum=tuple([0, 0]), changed_base_checksum=tuple([0, 0]),
                           payload_checksum=tuple([0, 0]))

    longest = max((name for name, _ in lim.tensors), key=len)
    widest = max((shape for _, shape in lim.tensors), key=len)
    entries = [entry(name, shape) for name, shape in lim.tensors]
    entries += [entry(longest, widest) for _ in range(lim.num_buckets)]  # a tensor split between two buckets
    return Manifest(version=0, base_version=0, kind="delta", entries=entries, bucket_sizes=[0] * lim.num_buckets,
                    num_elements=0, num_changed=0, layout=_text(LAYOUT_BYTES))


def _weight_update(lim: Limits, seen: Any) -> WeightUpdate:
    return WeightUpdate(manifest=_manifest(lim), buckets=[])


def _swap(lim: Limits, seen: Any) -> Any:
    """A push's handle: a broadcast's (its version), or an in-process update's (its
    manifest, when that is what crossed); the in-flight mode; asleep or not."""
    args = seen[0] if isinstance(seen, tuple) and seen and isinstance(seen[0], tuple) else ()
    in_process = bool(args) and isinstance(args[0], WeightUpdate)
    return _call(_weight_update(lim, seen) if in_process else BroadcastPush(version=0), _text(IN_FLIGHT_BYTES),
                 False)


def _queue_stats(lim: Limits, seen: Any) -> QueueStats:
    def named(what: str, make: Callable[[], Any]) -> dict[str, Any]:
        return {_text(QUEUE_NAME_BYTES, i): make() for i in range(min(len(getattr(seen, what, {})), QUEUE_NAMES))}

    return QueueStats(put=0, delivered=0, dropped=0, pending=0, in_flight=0, redelivered=0, capacity=0,
                      closed=False, dropped_by_reason=_reasons(getattr(seen, "dropped_by_reason", None)),
                      partitions=named("partitions", PartitionStats), consumers=named("consumers", ConsumerStats))


_NOTHING = _call()
_ALLOWANCES: dict[str, Callable[[Limits, Any], Any]] = {
    "generate_group (sent)": _group_request,
    "generate_group (received)": _group_report,
    "train_step (sent)": _batch_request,
    "train_step (received)": _step_report,
    "weight_update (sent)": lambda lim, seen: _NOTHING,
    "weight_update (received)": _weight_update,
    "swap_weights (sent)": _swap,
    "swap_weights (received)": lambda lim, seen: SwapReport(version=0, aborted=0),
    "release_weights (sent)": lambda lim, seen: _NOTHING,
    "release_weights (received)": lambda lim, seen: None,
    "weight_link (sent)": lambda lim, seen: _NOTHING,
    "weight_link (received)": lambda lim, seen: (_text(TRANSPORT_NAME_BYTES), _text(TRANSPORT_NAME_BYTES, 1), 0),
    "get_version (sent)": lambda lim, seen: _NOTHING,
    "get_version (received)": lambda lim, seen: 0,
    "broadcast_pending (sent)": lambda lim, seen: _NOTHING,
    "broadcast_pending (received)": lambda lim, seen: 0,
    "queue.statistics (sent)": lambda lim, seen: ("statistics",),
    "queue.statistics (received)": _queue_stats,
}
