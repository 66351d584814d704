"""Wire types: the metadata that moves between clients and the controller.

Only metadata crosses to the controller (tags, indices, counters); sample data
goes client <-> storage unit (see ``codec.py``). All of these are msgspec
Structs, so they encode as msgpack and pickle cheaply under Ray.
"""

from __future__ import annotations

import msgspec

__all__ = ["BatchMeta", "ConsumerStats", "PartitionStats", "QueueStats", "SampleTags", "Snapshot"]


class SampleTags(msgspec.Struct, kw_only=True, array_like=True):
    """What the controller learns about a sample from one write of some of its fields.

    ``mask`` is the bit set of the fields this write makes ready (``codec.fields_mask``).
    Version and length tags are ``-1`` when this write does not carry the field
    they are computed from (``token_versions``, ``prompt_ids``, ``response_ids``);
    the controller then keeps what it had.
    """

    uid: str
    group_id: str
    mask: int
    min_version: int = -1
    max_version: int = -1
    num_prompt_tokens: int = -1
    num_response_tokens: int = -1


class BatchMeta(msgspec.Struct, kw_only=True):
    """The controller's answer to a get: which global indices make up the batch.

    ``dropped`` counts, per reason, the samples this get dropped on the way
    (e.g. ``{"stale": 3}``); they are gone from the queue and counted in stats.
    """

    batch_id: str
    indices: list[int]
    fields_mask: int
    dropped: dict[str, int] = msgspec.field(default_factory=dict)


class ConsumerStats(msgspec.Struct, kw_only=True):
    """Per named consumer: what it holds now and what it has settled."""

    in_flight: int = 0  # samples it holds under lease right now
    delivered: int = 0  # samples it acknowledged
    nacked: int = 0  # samples it handed back with nack
    expired: int = 0  # samples whose lease ran out in its hands


class PartitionStats(msgspec.Struct, kw_only=True):
    """Per partition ("train", "val", ...): what is waiting there."""

    pending: int = 0  # registered, not leased (partial ones included)
    ready: int = 0  # pending with every sample field written
    in_flight: int = 0  # leased to a consumer


class QueueStats(msgspec.Struct, kw_only=True):
    """A snapshot of the queue's counters.

    Accounting identity, at every moment and across save/load:
    ``put == delivered + dropped + pending + in_flight``.
    """

    put: int  # distinct samples ever registered (put or first put_fields)
    delivered: int  # samples acknowledged by a consumer
    dropped: int  # samples removed without delivery; sum of dropped_by_reason
    pending: int  # samples waiting (partial or ready), not leased
    in_flight: int  # samples leased to a consumer, not yet acked
    redelivered: int  # samples returned to the ready set by nack or lease expiry
    capacity: int
    closed: bool
    dropped_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    partitions: dict[str, PartitionStats] = msgspec.field(default_factory=dict)
    consumers: dict[str, ConsumerStats] = msgspec.field(default_factory=dict)


class Snapshot(msgspec.Struct, kw_only=True):
    """The controller's part of a saved queue: counters and dead groups.

    The samples themselves are saved next to it by the client (see ``persist.py``).
    """

    put: int
    delivered: int
    redelivered: int
    dropped_by_reason: dict[str, int]
    # partition -> group ids killed by the staleness filter (late members are dropped)
    dead_groups: dict[str, list[str]]
    consumers: dict[str, ConsumerStats]
