"""SyncConfig: the ``sync`` section, the one set of weight-sync defaults.

:class:`sync.encode.WeightSender` is built from it (``WeightSender.from_config``)
and takes its keyword defaults from it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from sync import auto

__all__ = ["SyncConfig"]


class SyncConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How weights move from the trainer to the rollout engines."""

    mode: Literal["full", "delta", "auto"] = "auto"
    """Weight push encoding after the first full push: ``full``, ``delta`` (only
    the elements that changed, bit-exact) or ``auto``, by what is faster where the
    push goes (``sync.auto.mode_for``): ``full`` in one process or over CUDA IPC
    with the trainer on a GPU (device copies), else ``delta`` (the CPU, a broadcast,
    Ray's object store). A run records what it became in its first step's record
    (``startup/sync_mode``)."""
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
    in_flight: Literal["auto", "abort", "keep", "recompute"] = "auto"
    """What a push does to the generations running on an engine: ``abort`` (they
    end with their partial tokens and are resumed on the new weights with what is
    left of their budget; the only choice for vLLM and SGLang), ``keep`` (they
    continue on their cached KV under the new weights: no re-prefill, the KV of
    tokens before the push stays the old weights'), ``recompute`` (their KV is
    rebuilt with the new weights, their place kept). ``auto``: ``keep`` for the
    built-in engine (``recompute`` when ``colocated`` frees the KV cache), else
    ``abort``. Every token records the version that sampled it."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of the broadcast; ``auto``: NCCL when the
    trainer and every engine are on GPUs, else gloo."""

    def mode_for(self, transport: str, device: str) -> auto.Kind:
        """The push encoding over ``transport`` from a trainer on ``device``
        (``auto`` resolved by :func:`sync.auto.mode_for`)."""
        return auto.mode_for(transport, device) if self.mode == "auto" else self.mode

    def in_flight_for(self, engine_type: str) -> str:
        """The in-flight mode of a run whose engines are ``engine_type``
        (``auto`` resolved). Raises ValueError, one line, for a mode that engine
        or this ``colocated`` setting cannot do."""
        built_in = engine_type == "torch"
        mode = self.in_flight
        if mode == "auto":
            return ("recompute" if self.colocated else "keep") if built_in else "abort"
        if mode != "abort" and not built_in:
            raise ValueError(f"{mode!r} needs the built-in engine (rollout.engine.type=torch); "
                             f"a {engine_type} engine aborts its generations at a push: use 'abort'")
        if mode == "keep" and self.colocated:
            raise ValueError("'keep' needs the KV cache kept through a push, and sync.colocated=true frees it: "
                             "use 'recompute' or 'abort'")
        return mode

