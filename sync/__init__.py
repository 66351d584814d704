"""Weight sync: the update protocol (manifest + bounded payload buckets),
full and delta encodings, transports, and the pause -> push -> resume sequence.

    trainer: WeightSender.encode(weights, version) -> WeightUpdate
    wire:    Transport.send(update) -> handle;  Transport.receive(handle) -> WeightUpdate
    engine:  apply_update(weights, update, current_version) -> new version
    policy:  await sync_weights(engines, source, colocated=...) -> SyncResult
"""

from sync.apply import apply_update
from sync.encode import WeightSender
from sync.errors import BaseVersionMismatch, ChecksumError, ManifestMismatch, SyncFailed, WeightSyncError
from sync.manifest import Manifest, ShardSpec, TensorEntry, WeightUpdate, merge_updates

__all__ = [
    "BaseVersionMismatch",
    "ChecksumError",
    "Manifest",
    "ManifestMismatch",
    "ShardSpec",
    "SyncFailed",
    "TensorEntry",
    "WeightSender",
    "WeightSyncError",
    "WeightUpdate",
    "apply_update",
    "merge_updates",
]
