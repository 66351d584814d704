"""In-process transport: the buckets stay where the sender put them.

The handle is the update with each bucket replaced by a :class:`LocalBucket`,
a key into this process's registry: whoever passes the handle on (the policy
coroutine driving a sync) holds the manifest and keys, never the payload.
A receiver in the same process reads the sender's buckets without a copy.
"""

from __future__ import annotations

import itertools
from typing import cast

from contracts.weights import Bucket, WeightUpdate
from sync.transport.base import Transport

_registry: dict[int, Bucket] = {}
_keys = itertools.count()


class LocalBucket:
    """A payload bucket published in this process, by key."""

    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key

    def materialize(self) -> Bucket:
        try:
            return _registry[self.key]
        except KeyError:
            raise RuntimeError("an in-process weight bucket was read after its sender released it, "
                               "or in another process (use another transport there)") from None


class InProcessTransport(Transport[WeightUpdate]):
    """For a trainer and engines in one process (the ``local`` runtime, tests)."""

    name = "inproc"
    can_stage = True

    def send(self, update: WeightUpdate) -> WeightUpdate:
        refs: list[Bucket] = []
        for bucket in update.buckets:
            key = next(_keys)
            _registry[key] = bucket
            refs.append(LocalBucket(key))
        return WeightUpdate(manifest=update.manifest, buckets=refs)

    def receive(self, handle: WeightUpdate) -> WeightUpdate:
        if not isinstance(handle, WeightUpdate):
            raise TypeError(f"in-process transport expects a WeightUpdate handle, got {type(handle).__name__}")
        return WeightUpdate(manifest=handle.manifest, buckets=[cast(LocalBucket, b).materialize() for b in handle.buckets])

    def release(self, handle: WeightUpdate) -> None:
        for b in handle.buckets:
            _registry.pop(cast(LocalBucket, b).key, None)

