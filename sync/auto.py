"""What ``sync.mode: auto``, the default, pushes after the first full push.

Whether a full or a delta push is cheaper depends on where the push goes, not
on the run, so ``auto`` is a fixed rule of the transport and of the device the
trainer's weights are on, from whole pushes measured by ``bench.weight_sync``
(the same version pushed both ways from the same base, the kinds alternating):

    transport   weights on   mode    why
    inproc      a GPU        full    the planned full push (sync.device) is a few device
    cuda_ipc    a GPU        full    copies and one checksum kernel; the delta's compare,
                                     pack and checksum kernels take longer, and its apply
                                     stops the engine longer
    inproc      the CPU      delta   no planned path on the CPU: a full push casts, sums and
                                     copies every element; the native delta codec writes
                                     only the changed ones
    broadcast   either       delta   the payload crosses a link that is slow beside the
    ray         either       delta   encode (gloo, a network to other hosts) or is
                                     serialized through Ray's object store: the bytes
                                     sent dominate, and a delta sends a fraction of them

Kept results, in ``bench/results/weight_sync/`` (older runs in ``archive/weight_sync/``;
docs/benchmarks.md, "Weight push"): ``weight_sync_h100_*.json`` and
``weight_sync_h200_*.json`` (inproc and cuda_ipc on a GPU; the ``pickle`` transport of
``weight_sync_h200.json``, another process sent a serialized copy, stands for ``ray`` on
a GPU), ``weight_sync_cpu.json`` (inproc, ray and gloo on the CPU) and
``weight_sync_cpu_69b97c5.json`` (inproc and gloo on the CPU, measured again at the code
that made ``auto`` this rule).
A broadcast over NCCL to other hosts is not measured.

A rule, not a choice measured in the run: measuring the kind not chosen costs
whole pushes of it (on a slow link a full push every few syncs costs more than
the deltas between them), and every trainer worker has to pick the same kind
without asking the others. A run logs what ``auto`` became when its weight
link opens (``sync.link.open_weight_link``), and each push's kind as ``sync/kind``.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["full", "delta"]

TRANSPORTS = ("inproc", "cuda_ipc", "broadcast", "ray")


def mode_for(transport: str, device: str) -> Kind:
    """The kind ``sync.mode: auto`` pushes over ``transport`` (``inproc``,
    ``cuda_ipc``, ``broadcast`` or ``ray``) from weights on ``device``
    (``cpu``, ``cuda``, ``cuda:1``); the table above says why."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
    same_host_copy = transport in ("inproc", "cuda_ipc") and device.startswith("cuda")
    return "full" if same_host_copy else "delta"
