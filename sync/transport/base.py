"""The transport interface: how a :class:`~contracts.weights.WeightUpdate` gets
from the trainer's process to the engines'.

    sender side:    handle = transport.send(update)    # publish the buckets
    receiver side:  update = transport.receive(handle) # the same update, buckets readable
    both:           transport.close()

``handle`` is small and picklable (it is what a Ray actor call or an RPC
carries); collective transports (torch.distributed) return None and every
receiver calls ``receive(None)`` in step with the sender's ``send``.
"""

from __future__ import annotations

import abc
from typing import Generic, TypeVar

from contracts.weights import WeightUpdate

H = TypeVar("H")  # the handle a transport's ``send`` returns and its ``receive`` takes


class Transport(abc.ABC, Generic[H]):
    """Moves weight updates; one instance per process and side."""

    name: str = "?"
    # engines may check a payload ahead of the pause (sync.sequence._stage): a
    # handle exists before any receiver acts on it (not so for a collective) and
    # reading it twice costs nothing (no fetch: the payload stays where it is)
    can_stage: bool = False
    # the payload moves in a collective of a weight group that every member joins
    # first (sync.link forms it): the sender's send and the receivers' receive run
    # in step, so nothing is published ahead, and a push's handle names no payload
    # (contracts.weights.BroadcastPush)
    collective: bool = False

    @abc.abstractmethod
    def send(self, update: WeightUpdate) -> H:
        """Publish ``update``; return the handle receivers need (or None)."""

    @abc.abstractmethod
    def receive(self, handle: H) -> WeightUpdate:
        """Materialise the update behind ``handle`` (buckets may be read-only views)."""

    def release(self, handle: H) -> None:
        """Free what :meth:`send` published once every receiver has applied it."""

    def close(self) -> None:
        """Release everything this transport holds."""
