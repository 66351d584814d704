"""What the policy and a trainer actor exchange for one step: a batch request
in, a step report out. The batch itself goes TransferQueue → trainer."""

from __future__ import annotations

import msgspec

from contracts.sample import Sample

__all__ = ["BatchRequest", "StepReport"]


class BatchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Which batch the trainer takes from the TransferQueue for its next step:
    ``batch_size`` samples in whole groups of ``group_size``, for consumer
    ``consumer``; samples more than ``max_staleness`` versions behind
    ``current_version`` are dropped by the queue (``None``: no bound).
    ``group_ids``: the groups to train, whole, in this order (``batch_size ==
    len(group_ids) * group_size``); ``None``: the first whole groups to complete."""

    consumer: str = "trainer"
    batch_size: int
    group_size: int
    current_version: int
    max_staleness: int | None = None
    group_ids: list[str] | None = None
    num_examples: int = 0
    """How many of the batch's samples the report returns (``StepReport.examples``), 0 = none."""


class StepReport(msgspec.Struct, kw_only=True):
    """One trainer step as the policy sees it: counts and scalars only.

    ``num_samples`` were trained on and acknowledged; ``dropped`` counts, by
    reason, the samples the queue dropped while forming the batch;
    ``metrics`` holds the loss, the batch's reward, staleness and length
    statistics (``contracts.sample.batch_stats``) and the backend's figures."""

    version: int
    num_samples: int
    num_tokens: int
    wait_s: float
    train_s: float
    dropped: dict[str, int] = msgspec.field(default_factory=dict)
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    examples: list[Sample] = msgspec.field(default_factory=list)
    """A few of the trained samples, spread over the batch (``BatchRequest.num_examples``)."""
