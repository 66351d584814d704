"""The delta codec: one interface for how a piece's changes are found, written
as the streams of :mod:`sync.streams`, and applied. The implementation is
picked in one place, :func:`choose`, by device and element size:

    choose(device, itemsize, planned=) ─┬─ "triton"  sync/device_delta.py: an update laid out by sync.device,
                                        │            on a GPU: every piece at once, in a few kernels
                                        ├─ "c"       sync/native.py: CPU pieces of 2- or 4-byte elements,
                                        │            once its C kernels build
                                        └─ "torch"   sync/streams.py: anything else, any device and dtype;
                                                     the reference the others match byte for byte

    sender    encode_piece(writer, entry fields, old, new, ...) -> the piece's entry, written into a bucket
              positions(kept) -> the changed positions its undo log kept
              encode_planned_delta(plan, ...) -> the update of every piece of a plan
    receiver  apply_pieces([(piece, blob)], undo) -> per piece (old, new) checksums, or its error
              apply_planned_delta(weights, update) -> applied, or False for the per-piece path

A fast path is kept only where a kept measurement shows it pays (docs/benchmarks.md,
"Weight push"; ``bench/results/weight_sync/``): the Triton path made the delta push of a
494M-parameter bf16 model on a GPU about 80 times faster than the generic path, and the
C kernels made its delta on a CPU about four times faster than a numpy path.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal, NamedTuple, cast

import numpy as np
import torch

from contracts.weights import Checksum, Manifest, ShardSpec, TensorEntry, WeightUpdate, bucket_tensor, dtype_from_name
from sync import checksum as cks
from sync import device, device_delta, native, pool
from sync.buckets import BucketWriter
from sync.errors import ChecksumError, ManifestMismatch
from sync.piece import Piece
from sync.streams import IndexCodec, ValueCodec, as_bytes, decode_index, decode_sparse, encode_sparse, pick_codecs

Impl = Literal["triton", "c", "torch"]


def choose(device: torch.device | str, itemsize: int | None = None, *, planned: bool = False) -> Impl:
    """The implementation for pieces of ``itemsize``-byte elements on
    ``device``; ``planned``: for a whole update laid out by :mod:`sync.device`
    (a sender's plan, a receiver's region), where "torch" means the plan's own
    torch reference on the sender and the per-piece path on the receiver."""
    dev = torch.device(device)
    if planned:
        return "triton" if dev.type == "cuda" and device_delta.kernels_available() else "torch"
    if dev.type == "cpu" and itemsize is not None and native.supports(itemsize):
        return "c"
    return "torch"


# ---------------------------------------------------------------- sender


class Scratch:
    """Buffers a sender's CPU pieces reuse across pieces and syncs: the C
    kernels' outputs, and the buffer a trainer-dtype piece is cast into
    (fresh memory every piece costs page faults comparable to the work)."""

    def __init__(self) -> None:
        self.native = native.EncodeScratch()
        self._cast: torch.Tensor | None = None

    def cast(self, new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``new`` cast to ``dtype``, in the kept buffer."""
        n = new.numel()
        if self._cast is None or self._cast.dtype != dtype or self._cast.numel() < n:
            self._cast = torch.empty(n, dtype=dtype)
        buf = self._cast[:n]
        buf.copy_(new)
        return buf


class Changes(NamedTuple):
    """How one piece changed (:func:`_changes`).

    ``old_values``: the old values at the changed positions (``old``'s dtype,
    a copy the undo log may keep); ``new_values``: the new ones, None where the
    path did not gather them (C). ``codecs``: (index, value) codec of the sparse
    encoding, None when a raw copy of the piece is no larger; ``streams``: for
    them, the index, value and escape stream, each a list of uint8 chunks.
    ``sums``: piece-local (sum, index-weighted sum) of the old and of the new
    values at the changed positions, where the path had them while comparing
    (C). ``index``: the positions, ``("idx", int64 tensor)`` or ``(index codec,
    chunks)`` of a stream (C: the bitmask when ``codecs`` is None). ``impl``:
    which implementation made it."""

    num_changed: int
    old_values: torch.Tensor
    new_values: torch.Tensor | None
    codecs: tuple[IndexCodec, ValueCodec] | None
    streams: list[list[Any]]
    sums: tuple[Checksum, Checksum] | None
    index: tuple  # type: ignore[assignment]  # a field, not tuple.index
    impl: Impl


def encode_piece(writer: BucketWriter, common: dict, old: torch.Tensor, new: torch.Tensor,
                 shard: ShardSpec | None, base: Checksum, *, write_old: bool = False,
                 scratch: Scratch | None = None) -> tuple[TensorEntry, tuple, torch.Tensor] | None:
    """Encode how piece ``old`` (1-D, the last version sent) became ``new``
    (any float dtype, compared in ``old``'s) into ``writer``: sparse streams or
    raw values, whichever is smaller, its checksum moved from ``base`` by the
    changed elements only. Returns (entry, the changed positions as an undo log
    keeps them (:func:`positions`), the old values there), None if unchanged.
    ``common``: the entry's name, dtype, shape, shard, start and count.
    ``write_old``: ``old`` becomes ``new`` on the way (changed elements only)."""
    start, count = common["start"], common["count"]
    changes = _changes(old, new, write_old, scratch)
    k = changes.num_changed
    if k == 0:
        return None
    if changes.sums is not None and (shard is None or shard.is_contiguous):  # summed while comparing
        old_sum, new_sum = (cks.shift_sums(s, shard, start) for s in changes.sums)
    else:  # position weights need the shard's layout: the positions themselves
        idx = _changed_positions(changes, count)
        new_values = changes.new_values
        if new_values is None:
            new_values = old[idx] if write_old else new[idx].to(old.dtype)
        old_sum = cks.sparse_checksum(changes.old_values, idx, shard, start)
        new_sum = cks.sparse_checksum(new_values, idx, shard, start)
    checksum = cks.add(base, cks.sub(new_sum, old_sum))
    if changes.codecs is None:
        blob, written = as_bytes(new.to(old.dtype)), None
        bucket, offset = writer.add(blob)
        extra: dict = dict(encoding="raw")
    else:
        parts = _stream_sizes(changes)
        bucket, offset, blob = writer.reserve(sum(parts), old.device)
        written = blob
        extra = dict(encoding="sparse", index_codec=changes.codecs[0], value_codec=changes.codecs[1], parts=parts,
                     payload_checksum=_write_streams(changes, blob), changed_base_checksum=old_sum)
    entry = TensorEntry(**common, **extra, num_changed=k, bucket=bucket, offset=offset,
                        nbytes=blob.numel(), checksum=checksum, base_checksum=base)
    return entry, _kept_positions(changes, count, written), changes.old_values


def _changes(old: torch.Tensor, new: torch.Tensor, write_old: bool, scratch: Scratch | None) -> Changes:
    """How piece ``new`` differs bit for bit from ``old``, by the implementation :func:`choose` picks."""
    if choose(old.device, old.element_size()) == "c" and new.device.type == "cpu" and old.is_contiguous():
        return _encode_c(old, new, write_old, scratch or Scratch())
    idx, old_values, new_values, codecs, streams = encode_sparse(old, new, write_old)
    return Changes(idx.numel(), old_values, new_values, codecs, [[s] for s in streams], None, ("idx", idx), "torch")


def _encode_c(old: torch.Tensor, new: torch.Tensor, write_old: bool, scratch: Scratch) -> Changes:
    """The C kernel: one pass compares, emits every stream and sums, and
    updates ``old``; ``new`` in fp32 for a bf16 ``old`` is cast by the kernel
    (exactly as torch casts), other dtypes into the scratch first."""
    if new.dtype != old.dtype and not native.fuses_cast(old, new):
        new = scratch.cast(new, old.dtype)
    d = native.encode_piece(old, new.contiguous(), write_old, scratch.native)
    k, n, size = d.num_changed, old.numel(), old.element_size()
    # a copy (the scratch is reused): the sender's undo log keeps it
    olds = torch.from_numpy(np.concatenate(d.olds) if d.olds else np.empty(0, native._ELEM[size][1])).view(old.dtype)
    sums = (d.old_sums, d.new_sums)
    codecs = pick_codecs(n, k, size, d.index_size, d.num_escapes)
    if codecs is None:
        return Changes(k, olds, None, None, [], sums, ("bitmask", d.index["bitmask"]), "c")
    index_codec, value_codec = codecs
    u8 = [[c.view(np.uint8) for c in chunks] for chunks in ((d.vals, []) if value_codec == "raw" else (d.d8, d.esc))]
    return Changes(k, olds, None, codecs, [d.index[index_codec], *u8], sums, (index_codec, d.index[index_codec]), "c")


def _nbytes(chunk: torch.Tensor | np.ndarray) -> int:
    return chunk.numel() if isinstance(chunk, torch.Tensor) else chunk.size


def _stream_sizes(changes: Changes) -> tuple[int, int, int]:
    """Bytes of the index, value and escape stream (``TensorEntry.parts``)."""
    return tuple(sum(_nbytes(c) for c in s) for s in changes.streams)  # type: ignore[return-value]


def _write_streams(changes: Changes, blob: torch.Tensor) -> Checksum:
    """Copy the streams one after another into ``blob`` (exactly their size)
    and return its checksum, the entry's ``payload_checksum``."""
    chunks = [c for s in changes.streams for c in s]
    if changes.impl == "c":  # copied and summed in one call
        return native.pack_bytes(blob.numpy(), chunks)
    dst = blob.numpy() if not blob.is_cuda else None
    at = 0
    for c in chunks:  # straight into the bucket, no concatenated copy
        num = _nbytes(c)
        if dst is not None:  # numpy copies: no torch worker threads woken per small stream
            np.copyto(dst[at : at + num], c.numpy() if isinstance(c, torch.Tensor) else c)
        else:
            blob[at : at + num].copy_(c)
        at += num
    return cks.bytes_checksum(blob)


def _changed_positions(changes: Changes, count: int) -> torch.Tensor:
    """The int64 changed positions of a piece of ``count`` elements."""
    if changes.index[0] == "idx":
        return changes.index[1]
    codec, chunks = changes.index
    return decode_index(torch.from_numpy(np.concatenate(chunks)), codec, count, changes.num_changed)


def _kept_positions(changes: Changes, count: int, blob: torch.Tensor | None) -> tuple:
    """The changed positions in the compact form an undo log keeps (see
    :func:`positions`): int32 indices, or the index stream, pointed at in
    ``blob`` when :func:`_write_streams` put it there."""
    if changes.index[0] == "idx":
        return ("idx", changes.index[1].to(torch.int32))  # int32: the undo log is O(changed) and should stay small
    codec, chunks = changes.index
    if blob is not None and changes.codecs is not None:
        stream = blob[: _stream_sizes(changes)[0]]
    else:
        stream = torch.from_numpy(np.concatenate(chunks))
    return ("stream", codec, stream, count, changes.num_changed)


def positions(kept: tuple) -> torch.Tensor:
    """The int64 positions an undo log kept (:func:`encode_piece`)."""
    if kept[0] == "idx":
        return kept[1].to(torch.int64)
    _, codec, stream, count, k = kept
    return decode_index(stream, codec, count, k)


def encode_planned_delta(plan: device.SenderPlan, version: int, base_version: int,
                         base_sums: list[Checksum], bucket_bytes: int, *,
                         restore: bool = False) -> tuple[WeightUpdate, dict[int, Checksum]]:
    """A delta of every piece of ``plan`` at once, against the last version its
    storage holds (``restore``: back to the version before that one); the
    update, and the new checksum of each changed piece by its plan index."""
    if plan.delta is None:
        plan.delta = device_delta.DeltaPacker(plan)
    packer = plan.delta
    if restore:
        packer.restore_previous()
    else:
        torch._foreach_copy_(packer.cur_dst, plan.src)
    rows = packer.pack(kernels=choose(plan.storage.device, packer.itemsize, planned=True) == "triton")
    return device_delta.delta_update(plan, packer, rows, version, base_version, base_sums, bucket_bytes)


# ---------------------------------------------------------------- receiver


def apply_pieces(items: list[tuple[Piece, torch.Tensor]],
                 undo: list[Callable[[], None]]) -> list[tuple[Checksum, Checksum] | Exception]:
    """Decode the sparse payloads ``items`` (piece, blob) and write them: per
    piece, the checksums of its old and of its new values at the positions
    written (the caller compares them with the manifest), or the error that
    stopped it with nothing of it written (an undecodable payload: a
    ChecksumError). What was written is on ``undo`` before this returns. The
    C path takes its pieces all at once on the pool (pieces are disjoint)."""
    results: list[tuple[Checksum, Checksum] | Exception | None] = [None] * len(items)
    jobs = []
    for i, (piece, blob) in enumerate(items):
        flat = piece.np_piece()
        if flat is not None and choose(piece.device, flat.itemsize) == "c":
            jobs.append((i, flat, blob.cpu().numpy()))
    _apply_c(items, jobs, undo, results)
    for i, (piece, blob) in enumerate(items):
        if results[i] is None:
            results[i] = _apply_torch(piece, blob.to(piece.device), undo)
    return cast("list[tuple[Checksum, Checksum] | Exception]", results)  # every piece has its result by now


def _undecodable(e: TensorEntry, exc: Exception) -> ChecksumError:
    err = ChecksumError(f"{e.name}: undecodable sparse payload: {exc}")
    err.__cause__ = exc
    return err


def _apply_c(items: list[tuple[Piece, torch.Tensor]], jobs: list[tuple[int, np.ndarray, np.ndarray]],
             undo: list[Callable[[], None]], results: list[tuple[Checksum, Checksum] | Exception | None]) -> None:
    entries = [items[i][0].entry for i, _, _ in jobs]
    out = pool.run_each([partial(native.apply_piece, flat, blob, e.parts, e.index_codec or "", e.value_codec or "",
                                 e.count, e.num_changed) for (_, flat, blob), e in zip(jobs, entries)],
                        [e.num_changed for e in entries])
    for (_, flat, blob), e, r in zip(jobs, entries, out):
        if not isinstance(r, Exception):
            undo.append(partial(native.restore_piece, flat, blob, e.parts, e.index_codec or "", e.count, r[0]))
    for (i, _, _), e, r in zip(jobs, entries, out):  # a malformed blob raised with its piece as it was
        if isinstance(r, ValueError):
            results[i] = _undecodable(e, r)
        elif isinstance(r, Exception):
            results[i] = r
        else:
            results[i] = (cks.shift_sums(r[1], e.shard, e.start), cks.shift_sums(r[2], e.shard, e.start))


def _apply_torch(piece: Piece, blob: torch.Tensor, undo: list[Callable[[], None]]
                 ) -> tuple[Checksum, Checksum] | Exception:
    e = piece.entry
    try:
        idx, new, old = decode_sparse(blob, e.parts, e.index_codec or "", e.value_codec or "", e.count,
                                      e.num_changed, piece.read, piece.dtype)
    except (ValueError, RuntimeError, IndexError) as exc:
        return _undecodable(e, exc)
    old = piece.read(idx) if old is None else old
    sums = cks.sparse_checksum(old, idx, e.shard, e.start), cks.sparse_checksum(new, idx, e.shard, e.start)
    undo.append(partial(piece.write, idx, old))
    piece.write(idx, new)
    return sums


_DELTA_PLANS: dict[str, list[device_delta.DeltaReceiverPlan]] = {}  # layout -> plans (one per receiver here)


def apply_planned_delta(weights: dict[str, torch.Tensor], update: WeightUpdate) -> bool:
    """Apply a delta packed over a planned layout (:mod:`sync.device_delta`)
    with the Triton kernels, when :func:`choose` picks them for the buckets'
    device and every piece is a contiguous run of a receiver tensor of the
    sent dtype there; False to take the per-piece path."""
    m = update.manifest
    if len(update.buckets) != len(m.bucket_sizes) or not m.entries:
        return False
    region = device.contiguous_region([bucket_tensor(b) for b in update.buckets], m.bucket_sizes)
    if region is None or choose(region.device, planned=True) != "triton":
        return False
    itemsize = dtype_from_name(m.entries[0].dtype).itemsize
    blob_offsets = _blob_offsets(m, itemsize)
    found = None if blob_offsets is None else _delta_receiver(weights, m, region, itemsize)
    if found is None or blob_offsets is None:
        return False
    plan, indices = found
    plan.apply(m, region, blob_offsets, indices)
    return True


def _blob_offsets(m: Manifest, itemsize: int) -> list[int] | None:
    """Where each piece's blob starts in the region, when every entry is a
    planned one (bitmask + raw values, in range); None otherwise."""
    offsets = device.bucket_offsets(m.bucket_sizes)
    out = []
    for e in m.entries:
        k, mb = e.num_changed, -(-e.count // 8)
        if (e.encoding != "sparse" or e.index_codec != "bitmask" or e.value_codec != "raw" or k <= 0
                or not 0 <= e.bucket < len(offsets) or e.offset < 0 or e.offset + e.nbytes > m.bucket_sizes[e.bucket]
                or tuple(e.parts) != (mb, itemsize * k, 0) or e.nbytes != mb + itemsize * k
                or e.base_checksum is None):
            return None
        out.append(offsets[e.bucket] + e.offset)
    return out


def _delta_receiver(weights: dict[str, torch.Tensor], m: Manifest, region: torch.Tensor,
                    itemsize: int) -> tuple[device_delta.DeltaReceiverPlan, list[int]] | None:
    """This receiver's plan covering every piece of ``m`` and their indices in
    it (a new one when none does); None when the pieces do not fit one."""
    keys = [(e.name, e.shard, e.start, e.count) for e in m.entries]
    plans = _DELTA_PLANS.setdefault(m.layout, [])
    for p in plans:  # engines pass a fresh dict each time
        if (found := p.find(weights, keys)) is not None:
            return p, found
    # pieces of this receiver's older plan that this delta leaves out stay covered
    known = set(keys)
    older = next((p for p in plans if p.find(weights, []) is not None), None)
    entries = list(m.entries) + ([] if older is None else [
        e for e in older.entries if (e.name, e.shard, e.start, e.count) not in known])
    try:
        pieces = [Piece(weights, e) for e in entries]
    except ManifestMismatch:
        return None  # the per-piece path reports it
    views = [p.region_view() for p in pieces]
    if any(v is None or v.device != region.device or v.element_size() != itemsize for v in views):
        return None
    plan = device_delta.DeltaReceiverPlan(weights, entries, pieces)
    plans[:] = [plan] + [p for p in plans if p is not older][: device.MAX_PLANS - 1]
    for layout in [k for k in _DELTA_PLANS if k != m.layout][: max(0, len(_DELTA_PLANS) - device.MAX_PLANS)]:
        del _DELTA_PLANS[layout]  # layouts long replaced
    return plan, list(range(len(m.entries)))
