"""Ray object store transport: one ``ray.put`` per bucket.

The handle is the update with every bucket replaced by a :class:`RayBucket`
(an ``ObjectRef``), so it can travel as the argument of a Ray actor call;
``apply_update`` fetches each bucket when it reaches it. ``ray.get`` of a
numpy buffer maps the object store's shared memory, so on the receiving node
a bucket costs no private copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from contracts.weights import Bucket, WeightUpdate, bucket_tensor

if TYPE_CHECKING:
    import ray
from sync.transport.base import Transport


class RayBucket:
    """A payload bucket in the Ray object store."""

    __slots__ = ("ref",)

    def __init__(self, ref: ray.ObjectRef[np.ndarray]) -> None:
        self.ref = ref

    def materialize(self) -> np.ndarray:
        import ray

        return ray.get(self.ref)


def _to_numpy(buf: Bucket) -> np.ndarray:
    t = bucket_tensor(buf)
    return t.cpu().numpy() if t.is_cuda else t.numpy()


class RayObjectStoreTransport(Transport[WeightUpdate]):
    """Publishes buckets with ``ray.put`` (Ray must be initialised)."""

    name = "ray"

    def send(self, update: WeightUpdate) -> WeightUpdate:
        import ray

        refs: list[Bucket] = [RayBucket(ray.put(_to_numpy(b))) for b in update.buckets]
        return WeightUpdate(manifest=update.manifest, buckets=refs)

    def receive(self, handle: WeightUpdate) -> WeightUpdate:
        import ray

        arrays = ray.get([cast(RayBucket, b).ref for b in handle.buckets])
        return WeightUpdate(manifest=handle.manifest, buckets=list(arrays))

    def release(self, handle: WeightUpdate) -> None:
        # Objects are freed when the last reference goes; drop ours now so
        # a full model's worth of buckets does not wait for the next GC.
        handle.buckets = []


def tensor_from_ray(array: np.ndarray) -> torch.Tensor:
    """A read-only object-store array as a uint8 tensor (no copy)."""
    return bucket_tensor(array)
