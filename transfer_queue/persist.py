"""save / load / restore: a queue's unsettled samples and counters in one msgpack file.

Saved: every sample not yet delivered or dropped (pending, partial, and in
flight: an unacknowledged batch is not delivered, so it comes back ready), the
counters (put, delivered, dropped by reason, redelivered, per consumer) and the
groups the staleness filter killed. Load puts the samples back in their arrival
order, then restores the counters, so ``put == delivered + dropped + pending``
holds across a crash and resume. A sample registered but with no field written
yet at save time has nothing to save; it is counted as dropped,
``"unwritten_at_save"``. Save a quiet queue (producers and consumers paused):
a batch acked while save runs is not in the file, but may be in its counters.

The file is written to ``path + ".tmp"`` and renamed, so a crash mid-save
leaves the previous file intact. ``load`` starts a new local queue from the
file; ``restore`` fills a running, empty one of any deployment (a served or
Ray queue a resumed run has just started).
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from transfer_queue.codec import mask_fields
from transfer_queue.config import TransferQueueConfig
from contracts.sample import Sample
from transfer_queue.wire import Snapshot

if TYPE_CHECKING:
    from transfer_queue.client import TransferQueue

__all__ = ["load", "restore", "save"]

FORMAT_VERSION = 1


class _SavedRun(msgspec.Struct, kw_only=True):
    """Consecutive samples of one partition with the same written fields."""

    partition: str
    fields: list[str]
    samples: list[Sample]


class _SavedQueue(msgspec.Struct, kw_only=True):
    format_version: int
    counters: Snapshot
    runs: list[_SavedRun]


async def save(tq: TransferQueue, path: str) -> Snapshot:
    """Write the queue's unsettled samples and counters to ``path``; returns the
    counters saved (those samples included, ``unwritten_at_save`` counted)."""
    snap, by_partition = await tq._d.call("snapshot")
    runs: list[_SavedRun] = []
    for partition, items in by_partition.items():
        for mask, group in itertools.groupby(items, key=lambda item: item[1]):
            fields = mask_fields(mask)
            rows = await tq._d.read([index for index, _ in group], fields)
            runs.append(_SavedRun(partition=partition, fields=list(fields), samples=rows.samples()))
    num_saved = sum(len(r.samples) for r in runs)
    num_unsettled = snap.put - snap.delivered - sum(snap.dropped_by_reason.values())
    if num_unsettled > num_saved:
        snap.dropped_by_reason["unwritten_at_save"] = (
            snap.dropped_by_reason.get("unwritten_at_save", 0) + num_unsettled - num_saved
        )
    data = msgspec.msgpack.encode(
        _SavedQueue(format_version=FORMAT_VERSION, counters=snap, runs=runs), enc_hook=_arrays_as_lists
    )
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return snap


def _arrays_as_lists(value: object) -> list[object]:
    # Token fields put as numpy arrays are saved as lists (the format every version reads):
    # after load they are lists with the same values.
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot save a sample field of type {type(value).__name__}")


async def load(cls: type[TransferQueue], path: str, cfg: TransferQueueConfig) -> TransferQueue:
    saved = _read(path)
    tq = await cls.create(cfg)
    await _put_back(tq, saved)
    return tq


async def restore(tq: TransferQueue, path: str) -> Snapshot:
    """Put what ``save`` wrote into ``tq``, a running queue that has never
    registered a sample; returns the restored counters."""
    saved = _read(path)
    stats = await tq.statistics_async()
    if stats.put:
        raise RuntimeError(f"restore into a queue that already registered {stats.put} samples; "
                           "restore only into a new, empty queue")
    num_saved = sum(len(r.samples) for r in saved.runs)
    if num_saved > tq.cfg.capacity:
        raise ValueError(f"{path}: {num_saved} saved samples do not fit transfer_queue.capacity={tq.cfg.capacity}")
    await _put_back(tq, saved)
    return saved.counters


def _read(path: str) -> _SavedQueue:
    with open(path, "rb") as f:
        saved = msgspec.msgpack.decode(f.read(), type=_SavedQueue)
    if saved.format_version != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {saved.format_version}, this build reads {FORMAT_VERSION}")
    return saved


async def _put_back(tq: TransferQueue, saved: _SavedQueue) -> None:
    for run in saved.runs:
        await tq.put_fields(run.samples, run.fields, partition=run.partition, wait=False)
    await tq._d.call("restore", saved.counters)
