"""SyncConfig: the ``sync`` section, the one set of weight-sync defaults.

:class:`sync.encode.WeightSender` is built from it (``WeightSender.from_config``)
and takes its keyword defaults from it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = ["SyncConfig"]


class SyncConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How weights move from the trainer to the rollout engines."""

    mode: Literal["full", "delta", "auto"] = "delta"
    """Weight push encoding after the first full push."""
    full_every_k: Annotated[int, Meta(ge=0)] = 0
    """Force a full push every K versions (0 = never)."""
    bucket_bytes: Annotated[int, Meta(ge=1)] = 64 << 20
    """Payload bucket size: bounds the extra memory of a push."""
    colocated: bool = True
    """Trainer and engine share a device: free the KV cache during a push."""
    transport: Literal["auto", "inproc", "broadcast", "cuda_ipc", "ray"] = "auto"
    """How the payload goes from the trainer to the engines (never through the
    driver). ``auto``: by placement (``sync.link.choose_transport``): ``inproc``
    when they share a process, ``cuda_ipc`` between processes on GPUs of one
    host (engines map the trainer's buckets), ``broadcast`` otherwise
    (torch.distributed from the trainer's process to every rollout actor's,
    rendezvous on the trainer's node). ``ray``: buckets through Ray's object
    store. Any but ``auto`` and ``inproc`` needs one process per actor
    (``runtime.type`` ``process`` or ``ray``)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of the broadcast; ``auto``: NCCL when the
    trainer and every engine are on GPUs, else gloo."""
