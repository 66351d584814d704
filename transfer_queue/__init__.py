"""TransferQueue: the data plane between rollout actors and trainer actors."""

from transfer_queue.sample import Sample

__all__ = ["Sample"]
