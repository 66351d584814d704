"""The TransferQueue's errors: one class per way a call can fail.

In the style of anyio memory streams, "the queue was closed and you used it"
and "the queue is finished and empty for you" are different errors:

    QueueClosed   put (or put_fields) after close(): a programming error
    EndOfStream   get after close() when no batch can be formed any more: a normal end
    QueueFull     put(wait=False) while the queue is at capacity
    QueueEmpty    get_nowait() (or get with timeout_s=0) when no batch is ready yet
    LeaseLost     ack/nack of a batch that is not leased (expired, already acked, unknown)
    StorageUnitLost  (Ray) a storage unit died: its samples are dropped, counted as
                  "storage_lost", and it is replaced when a node can hold it; a ConnectionError too

A get with a finite ``timeout_s`` that runs out raises the builtin ``TimeoutError``.
"""

from __future__ import annotations

__all__ = ["EndOfStream", "LeaseLost", "QueueClosed", "QueueEmpty", "QueueFull", "StorageUnitLost", "TransferQueueError"]


class TransferQueueError(Exception):
    """Base class of every TransferQueue error."""


class QueueClosed(TransferQueueError):
    """The queue was closed; it takes no more samples."""


class EndOfStream(TransferQueueError):
    """The queue is closed and no further batch can be formed for this request."""


class QueueFull(TransferQueueError):
    """``put(wait=False)`` found no room for the samples under the capacity bound."""


class QueueEmpty(TransferQueueError):
    """``get_nowait`` found no batch ready to hand out."""


class LeaseLost(TransferQueueError):
    """ack/nack of a batch this queue no longer leases (its lease expired, or it was settled)."""


class StorageUnitLost(TransferQueueError, ConnectionError):
    """A storage unit is gone, and the rows it held with it (Ray deployment).

    The queue drops those samples, counted as ``"storage_lost"``, and starts a
    replacement (new samples only); the client sends its later puts to the other
    units until it is in. A call that needed the unit raises this; ``unit`` is -1
    when every unit is gone and none is coming (the message says why).
    """

    def __init__(self, unit: int, message: str) -> None:
        super().__init__(message)
        self.unit = unit

    def __reduce__(self) -> tuple:
        return (StorageUnitLost, (self.unit, str(self)))
