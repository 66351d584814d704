"""TransferQueue: the data plane between rollout actors and trainer actors.

    from transfer_queue import TransferQueue, TransferQueueConfig
    tq = await TransferQueue.create(TransferQueueConfig(capacity=4096))
    await tq.put(samples)                                   # producers
    batch = await tq.get("trainer", 64, sampler="grpo_group", group_size=8,
                         current_version=v, max_staleness=1)  # consumers
    ...; await tq.ack(batch.batch_id)

Metadata lives in a controller, data in storage units sharded by global index;
``deployment="local"`` runs both in this process, ``"ray"`` as Ray actors.
"""

from transfer_queue.batch import Batch
from transfer_queue.client import TransferQueue
from transfer_queue.config import TransferQueueConfig
from transfer_queue.errors import (
    EndOfStream,
    LeaseLost,
    QueueClosed,
    QueueEmpty,
    QueueFull,
    StorageUnitLost,
    TransferQueueError,
)
from contracts.sample import Sample
from transfer_queue.samplers import SAMPLERS, grpo_group, is_stale, sequential
from transfer_queue.wire import ConsumerStats, PartitionStats, QueueStats

__all__ = [
    "Batch",
    "ConsumerStats",
    "EndOfStream",
    "LeaseLost",
    "PartitionStats",
    "QueueClosed",
    "QueueEmpty",
    "QueueFull",
    "QueueStats",
    "SAMPLERS",
    "Sample",
    "StorageUnitLost",
    "TransferQueue",
    "TransferQueueConfig",
    "TransferQueueError",
    "grpo_group",
    "is_stale",
    "sequential",
]
