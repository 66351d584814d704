"""In-process transport: the update object itself is the handle."""

from __future__ import annotations

from sync.manifest import WeightUpdate
from sync.transport.base import Transport


class InProcessTransport(Transport):
    """For a trainer and engines in one process (tests, a laptop run):
    nothing is copied; receivers read the sender's buckets."""

    name = "inproc"

    def send(self, update: WeightUpdate) -> WeightUpdate:
        return update

    def receive(self, handle: WeightUpdate) -> WeightUpdate:
        if not isinstance(handle, WeightUpdate):
            raise TypeError(f"in-process transport expects a WeightUpdate handle, got {type(handle).__name__}")
        return handle
