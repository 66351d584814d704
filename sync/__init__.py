"""Weight sync: the update protocol (manifest + bounded payload buckets),
full and delta encodings, transports, and the pause -> push -> resume sequence.

    trainer: WeightSender.from_config(cfg.sync, dtype).encode(weights, version) -> WeightUpdate
    wire:    Transport.send(update) -> handle;  Transport.receive(handle) -> WeightUpdate
    engine:  apply_update(weights, update, current_version) -> new version
    policy:  await sync_weights(engines, source, colocated=...) -> SyncResult
"""

from sync.apply import apply_update
from sync.config import SyncConfig
from sync.encode import WeightSender
from sync.errors import BaseVersionMismatch, ChecksumError, ManifestMismatch, SyncFailed, WeightSyncError
from contracts.weights import Manifest, ShardSpec, TensorEntry, WeightUpdate, merge_updates
from sync.metrics import SyncMetrics, SyncResult
from sync.sequence import sync_weights
from sync.transport import Transport, make_transport

__all__ = [
    "BaseVersionMismatch",
    "ChecksumError",
    "Manifest",
    "ManifestMismatch",
    "ShardSpec",
    "SyncFailed",
    "SyncConfig",
    "SyncMetrics",
    "SyncResult",
    "TensorEntry",
    "Transport",
    "WeightSender",
    "WeightSyncError",
    "WeightUpdate",
    "apply_update",
    "make_transport",
    "merge_updates",
    "sync_weights",
]
