"""What one weight sync cost, for logs and for ``auto`` mode."""

from __future__ import annotations

from collections.abc import KeysView
from typing import Literal

import msgspec

from contracts.rollout import GenerateOutput


class SyncMetrics(msgspec.Struct, kw_only=True):
    """One sync. ``bytes_sent``: payload bytes published per receiver (all
    pushes, a full retry included). ``changed_fraction``: elements that differ
    from the base version (1.0 for full). Times in milliseconds: ``encode_ms``
    on the trainer, ``transfer_ms`` publishing through the transport,
    ``apply_ms`` the slowest engine's receive + apply, ``total_ms`` the whole
    sequence, ``paused_ms`` the longest time an engine did not generate, as the
    engine measured its swap (colocated: from ``prepare_swap`` to the swap's end is
    longer, the encode runs in between), ``engine_apply_ms`` the longest apply within
    a swap.
    ``sender_encode_ms``: the encode as the sender timed it, without the call
    that fetched it; ``source_ms``: the source's whole call (weights gathered,
    encoded, published) as it timed it, so ``encode_ms - source_ms`` is the
    call's trip; ``stage_ms``: the engines' check of a published payload
    before the pause, while they still generate (``stage_weights``; the swap is
    sent right behind it, so this time lies within ``apply_ms``);
    ``device_plan``: the update took the device fast path (:mod:`sync.device`)."""

    version: int
    kind: Literal["full", "delta"]
    bytes_sent: int
    changed_fraction: float
    encode_ms: float
    transfer_ms: float
    apply_ms: float
    total_ms: float = 0.0
    paused_ms: float = 0.0
    num_engines: int = 0
    num_full_retries: int = 0
    num_aborted: int = 0
    sender_encode_ms: float = 0.0
    source_ms: float = 0.0
    device_plan: bool = False
    stage_ms: float = 0.0
    engine_apply_ms: float = 0.0


class SyncResult(msgspec.Struct, kw_only=True):
    """The outcome of :func:`sync.sequence.sync_weights`. ``aborted[i]``:
    what engine ``i``'s ``abort`` returned: the partial outputs of its in-flight
    requests (resume them on the new weights), or their number from a rollout
    actor, which keeps and resumes them itself. Reads as a flat metrics
    mapping (``dict(result)``) for the policy's logs."""

    version: int
    metrics: SyncMetrics
    aborted: list[list[GenerateOutput] | int] = msgspec.field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return msgspec.structs.asdict(self.metrics)

    def keys(self) -> KeysView[str]:
        return self.as_dict().keys()

    def __getitem__(self, key: str) -> object:
        return self.as_dict()[key]
