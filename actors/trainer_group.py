"""TrainerGroup: ``trainer.num_workers`` trainer actors behind the one trainer
the policy and the weight link talk to (a drop-in for a single actor's handle).

    policy ─train_step(request)─► TrainerGroup ─each its share of the groups─► worker 0 .. n-1
           ◄─merged StepReport──               ◄─their StepReports───────────┘
    link   ─weight_update()────►              ─every worker─► its own shards ─► one merged WeightUpdate

Its endpoints are made from the ``TrainerHandle`` protocol (``contracts.handles``),
with the signature, types and docstring declared there. How each one asks the
workers is said once, in ``FAN_OUT``: the first worker alone, or every worker at
once and their answers merged. An endpoint that returns nothing goes to every
worker unless said otherwise; one the protocol gains that returns something fails
this module's import until ``FAN_OUT`` says how to merge it. ``train_step`` alone
is written out: it splits its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import typing
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import torch

from contracts.handles import TrainerHandle, TrainerWorkerHandle
from contracts.training import BatchRequest, StepReport
from contracts.weights import ShardSpec, WeightUpdate, merge_updates
from sync.link import digest_named

__all__ = ["FAN_OUT", "Fan", "TrainerGroup", "assemble_shards", "merge_reports"]

C = TypeVar("C", bound=type)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Fan:
    """How a :class:`TrainerGroup` answers one endpoint from its workers."""

    first: bool = False  # the first worker alone answers (the workers agree on it)
    merge: Callable[[list[Any]], Any] | None = None  # every worker's answer -> the group's; None: no answer
    method: str | None = None  # the workers' endpoint, when it is not the group's own


def _merged(updates: list[WeightUpdate | None]) -> WeightUpdate | None:
    """Every worker's update of its own shards, as one (``contracts.weights.merge_updates``)."""
    return None if updates[0] is None else merge_updates(updates)


def _first(answers: list[T]) -> T:
    return answers[0]


def _digest_assembled(parts: list[tuple[dict[str, torch.Tensor], dict[str, ShardSpec] | None]]) -> dict[str, str]:
    """sha256 of every full weight (the workers' shards assembled), by HF name."""
    return digest_named(assemble_shards(parts))


#: Each ``TrainerHandle`` endpoint but ``train_step``, as the group asks its workers.
#: Not listed: every worker, nothing returned (save, load, release_weights, ...).
FAN_OUT: dict[str, Fan] = {
    "get_version": Fan(first=True),
    "placement": Fan(first=True),
    "open_weight_link": Fan(merge=_first),  # every worker opens its end; the first one's rendezvous
    "weight_update": Fan(merge=_merged),
    "revert_update": Fan(merge=_merged),
    "broadcast_pending": Fan(merge=sum),
    "weights_digest": Fan(merge=_digest_assembled, method="local_weights"),
}


def _endpoint(name: str, declared: Callable[..., object], fan: Fan) -> Callable[..., Awaitable[object]]:
    """The group's endpoint ``name``: asks its workers as ``fan`` says; looks like ``declared``
    (the protocol's) to ``inspect`` and ``typing.get_type_hints``."""
    method = fan.method or name
    if fan.first:
        async def endpoint(self: TrainerGroup, *args: object, **kwargs: object) -> object:
            return await getattr(self.workers[0], method)(*args, **kwargs)
    else:
        async def endpoint(self: TrainerGroup, *args: object, **kwargs: object) -> object:
            answers = await self._all(method, *args, **kwargs)
            return None if fan.merge is None else fan.merge(answers)
    functools.update_wrapper(endpoint, declared)
    endpoint.__qualname__, endpoint.__module__ = f"TrainerGroup.{name}", __name__
    return endpoint


def _endpoints_of(protocol: type, fan_out: dict[str, Fan]) -> Callable[[C], C]:
    """Give the class every async endpoint of ``protocol`` it does not write out itself."""

    def build(cls: C) -> C:
        declared = dict(inspect.getmembers(protocol, inspect.iscoroutinefunction))
        unknown = set(fan_out) - set(declared)
        assert not unknown, f"FAN_OUT names what {protocol.__name__} does not declare: {sorted(unknown)}"
        for name, fn in declared.items():
            if name in vars(cls):
                continue
            fan = fan_out.get(name)
            if fan is None:
                if typing.get_type_hints(fn).get("return") is not type(None):
                    raise TypeError(f"{protocol.__name__}.{name} returns an answer: say in FAN_OUT how "
                                    f"{cls.__name__} merges its workers' answers")
                fan = Fan()
            setattr(cls, name, _endpoint(name, fn, fan))
        return cls

    return build


@_endpoints_of(TrainerHandle, FAN_OUT)
class TrainerGroup:
    """``trainer.num_workers`` trainer actors behind the one trainer the policy
    and the weight link talk to (a drop-in for a single actor's handle).

    A step asks every worker for its share of the batch's groups at once: each
    takes its own from the queue (one consumer, so every sample goes to exactly
    one of them), the backend reduces gradients across the trainers' group, and
    the reports merge into one. A weight update is every worker's update of
    its own shards, merged (``contracts.weights.merge_updates``); over ``broadcast``
    the workers broadcast in rank order and each engine merges what it got.
    Every other ``TrainerHandle`` endpoint asks the workers as ``FAN_OUT`` says."""

    def __init__(self, workers: list[TrainerWorkerHandle]) -> None:
        self.workers = workers

    async def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return list(await asyncio.gather(*(getattr(w, method)(*args, **kwargs) for w in self.workers)))

    async def train_step(self, request: BatchRequest) -> StepReport:
        n = len(self.workers)
        share = msgspec.structs.replace(request, batch_size=request.batch_size // n)
        if request.group_ids is None:
            return merge_reports(await self._all("train_step", share))
        # named groups: each worker takes its contiguous share of them, in order
        per = len(request.group_ids) // n
        shares = [msgspec.structs.replace(share, group_ids=request.group_ids[i * per:(i + 1) * per]) for i in range(n)]
        return merge_reports(list(await asyncio.gather(*(w.train_step(r) for w, r in zip(self.workers, shares)))))


def merge_reports(reports: list[StepReport]) -> StepReport:
    """One step's report from every worker's: counts summed, the slowest
    worker's times, batch statistics weighted by samples (maxima kept as
    maxima); the backend's ``train/*`` figures are the whole batch's on every
    worker (reduced across the group), so the first worker's are taken."""
    versions = {r.version for r in reports}
    if len(versions) != 1:
        raise RuntimeError(f"trainer workers disagree on the version after a step: {sorted(versions)}")
    n = sum(r.num_samples for r in reports)
    dropped: dict[str, int] = {}
    for r in reports:
        for k, v in r.dropped.items():
            dropped[k] = dropped.get(k, 0) + v
    metrics = dict(reports[0].metrics)
    for key in reports[0].metrics:
        if key.startswith("train/"):
            continue
        values = [r.metrics[key] for r in reports]
        metrics[key] = max(values) if key.endswith("_max") or key.startswith("max_") else (
            sum(v * r.num_samples for v, r in zip(values, reports)) / max(n, 1))
    return StepReport(version=reports[0].version, num_samples=n, num_tokens=sum(r.num_tokens for r in reports),
                      wait_s=max(r.wait_s for r in reports), train_s=max(r.train_s for r in reports),
                      dropped=dropped, metrics=metrics, examples=[e for r in reports for e in r.examples])


def assemble_shards(parts: list[tuple[dict[str, torch.Tensor], dict[str, ShardSpec] | None]]
                    ) -> dict[str, torch.Tensor]:
    """Full tensors from every worker's ``(named local tensors, shard specs)``."""
    first, specs = parts[0]
    if specs is None:
        return first
    out = {}
    for name, t in first.items():
        full = torch.empty(specs[name].full_shape, dtype=t.dtype)
        for weights, spec in parts:
            s = spec[name]
            full.narrow(s.dim, s.offset, s.length).copy_(weights[name])
        out[name] = full
    return out
