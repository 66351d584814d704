"""The receiver side: apply a full or delta update in place, all or nothing.

    phase 1  check, write nothing: version, names, shapes, offsets, payload
             checksums (raw pieces: the checksum of the values they carry)
    phase 2  write piece by piece, keeping the old values at the changed
             positions; check that the old values sum to the base's there and
             base checksum + (new - old) equals the target checksum (on CPU a
             sparse piece is decoded, checked, written and summed in one pass
             over its changed positions by the C kernel of sync.native, all
             such pieces at once on its thread pool, or by numpy without a
             compiler, so it is checked just after it is written)
    failure  write the kept old values back in reverse order and raise

Extra memory is one decoded piece (<= a bucket) plus, for a delta, the old
values at changed positions; a full update needs no undo log because phase 1
has already proved that its payload is the target.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import numpy as np
import torch

from sync import checksum as cks
from sync import device
from sync import device_delta
from sync import native
from sync.codec import apply_sparse_np, decode_sparse
from sync.errors import BaseVersionMismatch, ChecksumError, ManifestMismatch, WeightSyncError
from contracts.weights import TensorEntry, WeightUpdate, bucket_tensor, dtype_from_name


_WIDER = {
    torch.bfloat16: {torch.float32, torch.float64},
    torch.float16: {torch.float32, torch.float64},
    torch.float32: {torch.float64},
}


def _holds_exactly(receiver: torch.dtype, sent: torch.dtype) -> bool:
    return receiver == sent or receiver in _WIDER.get(sent, set())


class _Piece:
    """Read/write access to one entry's elements of a receiver tensor, in the
    entry's dtype, addressed by piece-local flat index."""

    def __init__(self, weights: dict[str, torch.Tensor], e: TensorEntry) -> None:
        w = weights.get(e.name)
        if w is None:
            raise ManifestMismatch(f"receiver has no tensor named {e.name!r}")
        if tuple(w.shape) != tuple(e.shape):
            raise ManifestMismatch(f"{e.name}: receiver shape {tuple(w.shape)} != manifest shape {tuple(e.shape)}")
        self.dtype = dtype_from_name(e.dtype)
        if not _holds_exactly(w.dtype, self.dtype):
            raise ManifestMismatch(f"{e.name}: receiver dtype {w.dtype} cannot hold {self.dtype} values exactly")
        self.entry = e
        self.device = w.device
        region = w if e.shard is None else w.narrow(e.shard.dim, e.shard.offset, e.shard.length)
        if e.start < 0 or e.count < 0 or e.start + e.count > region.numel():
            raise ManifestMismatch(f"{e.name}: piece [{e.start}, {e.start + e.count}) out of range")
        if region.is_contiguous():
            self._flat, self._base = region.view(-1), e.start
            self._positions = None
        else:
            if not w.is_contiguous():
                raise ManifestMismatch(f"{e.name}: receiver tensor must be contiguous for a sharded update")
            self._flat, self._base = w.view(-1), 0
            self._positions = e.shard  # map piece indices through the shard spec

    def np_piece(self) -> np.ndarray | None:
        """The piece as a writable numpy integer view when it is on the CPU,
        contiguous in the full tensor and held in the entry's dtype (the
        fused sparse apply works on it); None otherwise."""
        e = self.entry
        if self.device.type != "cpu" or self._positions is not None or self._flat.dtype != self.dtype:
            return None
        if e.shard is not None and not e.shard.is_contiguous:
            return None
        return cks.int_view(self._flat).numpy()[self._base : self._base + e.count]

    def region_view(self) -> torch.Tensor | None:
        """The piece's elements as a view of the receiver tensor when they are
        contiguous there and held in the entry's dtype; None otherwise."""
        if self._positions is not None or self._flat.dtype != self.dtype:
            return None
        return self._flat[self._base : self._base + self.entry.count]

    def _index(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx.to(self.device) + self.entry.start
        return local if self._positions is None else self._positions.global_positions(local)

    def read_all(self) -> torch.Tensor:
        if self._positions is None:
            return self._flat[self._base : self._base + self.entry.count].to(self.dtype)
        return self.read(torch.arange(self.entry.count, device=self.device))

    def write_all(self, values: torch.Tensor) -> None:
        if self._positions is None:
            self._flat[self._base : self._base + self.entry.count].copy_(values)
        else:
            self.write(torch.arange(self.entry.count, device=self.device), values)

    def _pos(self, idx: torch.Tensor) -> torch.Tensor:
        return self._index(idx) if self._positions is not None else idx.to(self.device) + self._base

    def _np_piece(self, idx: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(integer numpy view to index, indices into it) on CPU: slicing the
        piece out is free, adding its offset to every index is not."""
        if self._positions is None:
            flat = cks.int_view(self._flat).numpy()[self._base : self._base + self.entry.count]
            return flat, idx.numpy()
        return cks.int_view(self._flat).numpy(), self._index(idx).numpy()

    def read(self, idx: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":  # numpy's gather is several times faster than torch's on CPU
            flat, at = self._np_piece(idx)
            return torch.from_numpy(flat[at]).view(self._flat.dtype).to(self.dtype)
        return self._flat[self._pos(idx)].to(self.dtype)

    def write(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        values = values.to(device=self.device, dtype=self._flat.dtype)
        if self.device.type == "cpu":
            flat, at = self._np_piece(idx)
            flat[at] = cks.int_view(values).numpy()
        else:
            self._flat[self._pos(idx)] = values


def _blob(update: WeightUpdate, e: TensorEntry, buckets: dict[int, torch.Tensor]) -> torch.Tensor:
    if not 0 <= e.bucket < len(update.buckets):
        raise ManifestMismatch(f"{e.name}: bucket {e.bucket} does not exist")
    bucket = buckets.get(e.bucket)
    if bucket is None:  # resolve each (possibly remote) bucket once per apply
        bucket = buckets[e.bucket] = bucket_tensor(update.buckets[e.bucket])
    if e.offset < 0 or e.offset + e.nbytes > bucket.numel():
        raise ManifestMismatch(f"{e.name}: payload [{e.offset}, {e.offset + e.nbytes}) outside bucket {e.bucket}")
    return bucket[e.offset : e.offset + e.nbytes]


def _raw_values(blob: torch.Tensor, piece: _Piece) -> torch.Tensor:
    e = piece.entry
    if e.nbytes != e.count * torch.empty(0, dtype=piece.dtype).element_size():
        raise ManifestMismatch(f"{e.name}: raw payload of {e.nbytes} bytes for {e.count} elements")
    if blob.data_ptr() % 8:  # a view must be aligned to the element size
        blob = blob.clone()
    return blob.view(piece.dtype)


def _promised(e: TensorEntry) -> Any:
    """The checksum the manifest promises for a piece's payload (an unknown
    encoding is refused here, whatever its bytes summed to)."""
    if e.encoding == "raw":
        return e.checksum
    if e.encoding == "sparse":
        return e.payload_checksum
    raise ManifestMismatch(f"{e.name}: unknown encoding {e.encoding!r}")


def _compare(e: TensorEntry, got: cks.Checksum) -> None:
    if got != tuple(_promised(e) or ()):
        raise ChecksumError(f"{e.name}[{e.start}:{e.start + e.count}]: payload checksum mismatch")


def _check_cpu_blob(piece: _Piece, blob: torch.Tensor) -> None:
    e = piece.entry
    if e.encoding == "raw":
        _compare(e, cks.piece_checksum(_raw_values(blob, piece), e.shard, e.start))
    else:
        _compare(e, cks.bytes_checksum(blob))


def _device_payload_sums(items: list[tuple[_Piece, torch.Tensor]]) -> list[torch.Tensor]:
    """Each device blob's sums, left on the device; raw pieces summed together."""
    out: list[torch.Tensor | None] = [None] * len(items)
    raw = []
    for i, (piece, blob) in enumerate(items):
        e = piece.entry
        if e.encoding == "raw":
            raw.append((i, (_raw_values(blob, piece), e.shard, e.start)))
        else:
            out[i] = cks.bytes_sums(blob)
    for (i, _), sums in zip(raw, cks.pieces_sums([r[1] for r in raw])):
        out[i] = sums
    return out  # type: ignore[return-value]


def _check_payload(update: WeightUpdate, pieces: list[_Piece], buckets: dict[int, torch.Tensor]) -> None:
    """Phase 1. CPU payloads are checked on the sync.native thread pool (the
    numpy passes release the GIL); device ones on this thread's stream, their
    sums read back together (one wait on the device per update)."""
    on_cpu, cpu_sizes, on_device, sparse = [], [], [], []
    batch = native.available()  # sparse CPU payloads: summed together by the C kernel
    for piece in pieces:
        blob = _blob(update, piece.entry, buckets)
        if blob.device.type != "cpu":
            on_device.append((piece, blob))
        elif batch and piece.entry.encoding == "sparse":
            sparse.append((piece, blob))
            on_cpu.append(len(sparse) - 1)
        else:
            on_cpu.append(partial(_check_cpu_blob, piece, blob))
            cpu_sizes.append(piece.entry.count)
    for (piece, _), got in zip(on_device, cks.read_sums(_device_payload_sums(on_device))):
        _compare(piece.entry, got)
    sparse_sums = native.bytes_sums_many([blob for _, blob in sparse]) if sparse else []
    done = iter(native.run_each([c for c in on_cpu if not isinstance(c, int)], cpu_sizes))
    for c in on_cpu:  # the first bad piece in manifest order is the one reported
        if isinstance(c, int):
            _compare(sparse[c][0].entry, sparse_sums[c])
        elif isinstance(r := next(done), Exception):
            raise r


def _apply_native(update: WeightUpdate, pieces: list[_Piece], buckets: dict[int, torch.Tensor],
                  undo: list[Callable[[], None]]) -> set[int]:
    """Phase 2 for the sparse CPU pieces the C kernel handles: decode, write
    and sum them all at once on the sync.native pool (pieces are disjoint),
    then check each. Returns the indices of the pieces done; whatever was
    written is on ``undo`` before anything can raise."""
    jobs = []
    for i, piece in enumerate(pieces):
        e = piece.entry
        flat = piece.np_piece() if e.encoding == "sparse" else None
        if flat is None or not native.supports(flat.itemsize):
            continue
        blob = _blob(update, e, buckets).cpu().numpy()
        jobs.append((i, flat, blob, partial(native.apply_piece, flat, blob, e.parts, e.index_codec or "",
                                            e.value_codec or "", e.count, e.num_changed)))
    results = native.run_each([job[-1] for job in jobs], [pieces[job[0]].entry.num_changed for job in jobs])
    for (i, flat, blob, _), r in zip(jobs, results):
        if not isinstance(r, Exception):
            e = pieces[i].entry
            undo.append(partial(native.restore_piece, flat, blob, e.parts, e.index_codec, e.count, r[0]))
    for (i, *_), r in zip(jobs, results):  # a malformed blob raised with its piece as it was
        e = pieces[i].entry
        if isinstance(r, ValueError):
            raise ChecksumError(f"{e.name}: undecodable sparse payload: {r}") from r
        if isinstance(r, Exception):
            raise r
        _check_delta_sums(e, cks.shift_sums(r[1], e.shard, e.start), cks.shift_sums(r[2], e.shard, e.start))
    return {job[0] for job in jobs}


def _check_delta_sums(e: TensorEntry, old_sum: cks.Checksum, new_sum: cks.Checksum) -> None:
    """The receiver held the base values where the delta writes, and the
    delta takes the piece's checksum from base to target (O(changed) work)."""
    if old_sum != e.changed_base_checksum:
        raise ChecksumError(f"{e.name}[{e.start}:{e.start + e.count}]: receiver values differ from the base version")
    if e.base_checksum is None or cks.add(e.base_checksum, cks.sub(new_sum, old_sum)) != e.checksum:
        raise ChecksumError(f"{e.name}[{e.start}:{e.start + e.count}]: delta does not produce the target checksum")


_PLANS: dict[str, list[device.ReceiverPlan]] = {}  # layout -> checked plans (one per receiver in this process)
_MAX_PLANS = 4  # per layout


def _apply_planned(weights: dict[str, torch.Tensor], update: WeightUpdate) -> bool:
    """Apply a full update laid out for the device fast path (:mod:`sync.device`)
    when its layout checks out against ``weights``; False to take the generic path."""
    planned = _planned(weights, update)
    if planned is None:
        return False
    plan, region = planned
    plan.apply(update.manifest, region)
    return True


def stage_update(weights: dict[str, torch.Tensor], update: WeightUpdate) -> bool:
    """Check ``update``'s payload ahead of :func:`apply_update`, writing nothing:
    a receiver does it while its engine still generates, so that the apply,
    with the engine paused, only copies. True when checked (a planned full
    update); False when the apply will check as it goes (any other update).
    Raises :class:`~sync.errors.ChecksumError` for a corrupt payload."""
    m = update.manifest
    planned = _planned(weights, update) if stageable(m) else None
    if planned is None:
        return False
    plan, region = planned
    plan.check(m, region)
    return True


def stageable(manifest: Any) -> bool:
    """Whether :func:`stage_update` can check an update of this manifest ahead."""
    return bool(manifest.layout) and manifest.kind == "full"


def _planned(weights: dict[str, torch.Tensor], update: WeightUpdate) -> tuple[device.ReceiverPlan, torch.Tensor] | None:
    """The receiver's plan for a full planned update and the buckets as one
    region, when its layout checks out against ``weights``; None otherwise."""
    m = update.manifest
    if len(update.buckets) != len(m.bucket_sizes) or not m.entries:
        return None
    region = device.contiguous_region([bucket_tensor(b) for b in update.buckets], m.bucket_sizes)
    if region is None:
        return None
    plans = _PLANS.setdefault(m.layout, [])
    plan = next((p for p in plans if p.still_valid(weights)), None)  # engines pass a fresh dict each time
    if plan is None:
        plan = _plan_receiver(weights, m, region)
        if plan is None:
            return None
        for layout, others in list(_PLANS.items()):  # this receiver's plans of other layouts: stale,
            if layout != m.layout:                     # and they hold views of the sender's old buckets
                others[:] = [p for p in others if not p.still_valid(weights)]
                if not others:
                    del _PLANS[layout]
        plans.insert(0, plan)
        del plans[_MAX_PLANS:]
    return plan, region


def _plan_receiver(weights: dict[str, torch.Tensor], m: Any, region: torch.Tensor) -> device.ReceiverPlan | None:
    """Check a layout once: every piece raw, block-aligned, and a contiguous
    run of a receiver tensor of exactly its dtype on the buckets' device."""
    if device.layout_digest(m.entries, m.bucket_sizes) != m.layout:
        return None
    try:
        pieces = [_Piece(weights, e) for e in m.entries]
    except ManifestMismatch:
        return None  # the generic path reports it
    itemsize = pieces[0].dtype.itemsize
    block_bytes = device.BLOCK * itemsize
    offsets = device.bucket_offsets(m.bucket_sizes)
    if sum(m.bucket_sizes) % block_bytes or itemsize not in (2, 4):
        return None
    for piece in pieces:
        e = piece.entry
        if (e.encoding != "raw" or piece.dtype.itemsize != itemsize or piece.device != region.device
                or piece.region_view() is None or e.nbytes != e.count * itemsize
                or not 0 <= e.bucket < len(offsets) or e.offset < 0 or e.offset + e.nbytes > m.bucket_sizes[e.bucket]
                or (offsets[e.bucket] + e.offset) % block_bytes):
            return None
    return device.ReceiverPlan(weights, m, region, pieces)


_DELTA_PLANS: dict[str, list[device_delta.DeltaReceiverPlan]] = {}  # layout -> plans (one per receiver here)


def _apply_planned_delta(weights: dict[str, torch.Tensor], update: WeightUpdate) -> bool:
    """Apply a delta packed over a planned layout (:mod:`sync.device_delta`)
    with the delta kernels when the receiver's pieces are GPU tensors of the
    sent dtype; False to take the generic path."""
    m = update.manifest
    if len(update.buckets) != len(m.bucket_sizes) or not m.entries:
        return False
    region = device.contiguous_region([bucket_tensor(b) for b in update.buckets], m.bucket_sizes)
    if region is None or not device_delta.receiver_kernels_available(region):
        return False
    offsets = device.bucket_offsets(m.bucket_sizes)
    blob_offsets = []
    itemsize = dtype_from_name(m.entries[0].dtype).itemsize
    for e in m.entries:
        k, mb = e.num_changed, -(-e.count // 8)
        if (e.encoding != "sparse" or e.index_codec != "bitmask" or e.value_codec != "raw" or k <= 0
                or not 0 <= e.bucket < len(offsets) or e.offset < 0 or e.offset + e.nbytes > m.bucket_sizes[e.bucket]
                or tuple(e.parts) != (mb, itemsize * k, 0) or e.nbytes != mb + itemsize * k
                or e.base_checksum is None):
            return False
        blob_offsets.append(offsets[e.bucket] + e.offset)
    keys = [(e.name, e.shard, e.start, e.count) for e in m.entries]
    plans = _DELTA_PLANS.setdefault(m.layout, [])
    plan, found = None, None
    for p in plans:  # engines pass a fresh dict each time
        if (found := p.find(weights, keys)) is not None:
            plan = p
            break
    if plan is None:
        # pieces of this receiver's older plan that this delta leaves out stay covered
        known = set(keys)
        older = next((p for p in plans if p.find(weights, []) is not None), None)
        entries = list(m.entries) + ([] if older is None else [
            e for e in older.entries if (e.name, e.shard, e.start, e.count) not in known])
        try:
            pieces = [_Piece(weights, e) for e in entries]
        except ManifestMismatch:
            return False  # the generic path reports it
        views = [p.region_view() for p in pieces]
        if any(v is None or v.device != region.device or v.element_size() != itemsize for v in views):
            return False
        plan = device_delta.DeltaReceiverPlan(weights, entries, pieces)
        found = list(range(len(m.entries)))
        plans[:] = [plan] + [p for p in plans if p is not older][: _MAX_PLANS - 1]
        for layout in [k for k in _DELTA_PLANS if k != m.layout][: max(0, len(_DELTA_PLANS) - _MAX_PLANS)]:
            del _DELTA_PLANS[layout]  # layouts long replaced
    plan.apply(m, region, blob_offsets, found)
    return True


def apply_update(
    weights: dict[str, torch.Tensor],
    update: WeightUpdate,
    current_version: int,
    *,
    verify: Literal["incremental", "full"] = "incremental",
) -> int:
    """Write ``update`` into ``weights`` (HF name -> tensor, any device and
    float dtype that holds the update's dtype exactly) and return the new version.

    Raises :class:`~sync.errors.BaseVersionMismatch` when a delta's base is
    not ``current_version``, :class:`~sync.errors.ChecksumError` for a corrupt
    payload or a result that would not match, and
    :class:`~sync.errors.ManifestMismatch` for unknown names or shapes; in
    every case the tensors are left exactly as they were. Every piece a delta
    touches is re-read afterwards and its whole checksum compared with the
    target, so a receiver that drifted anywhere in it (not only where the
    delta writes) refuses the delta (the sync then pushes full; a pass over
    those pieces; the device path checks each whole piece's base in its one
    pass). ``verify="full"`` re-reads full updates' pieces too.
    """
    m = update.manifest
    if m.layout and m.kind == "full" and verify != "full" and _apply_planned(weights, update):
        return m.version
    if m.kind == "delta" and m.base_version != current_version:
        raise BaseVersionMismatch(m.base_version, current_version)
    if m.layout and m.kind == "delta" and verify != "full" and _apply_planned_delta(weights, update):
        return m.version
    if len(update.buckets) != len(m.bucket_sizes):
        raise ManifestMismatch(f"{len(update.buckets)} buckets for a manifest of {len(m.bucket_sizes)}")
    pieces = [_Piece(weights, e) for e in m.entries]
    buckets: dict[int, torch.Tensor] = {}
    _check_payload(update, pieces, buckets)

    undo: list[Callable[[], None]] = []  # each writes one piece's old values back
    try:
        done = _apply_native(update, pieces, buckets, undo)
        for i, piece in enumerate(pieces):
            if i in done:
                continue
            e = piece.entry
            blob = _blob(update, e, buckets).to(piece.device)
            if e.encoding == "raw":
                new = _raw_values(blob, piece)
                if m.kind == "delta":
                    old = piece.read_all()
                    if e.base_checksum is not None and cks.piece_checksum(old, e.shard, e.start) != e.base_checksum:
                        raise ChecksumError(f"{e.name}: receiver values differ from the base version")
                    idx = torch.nonzero(cks.int_view(old) != cks.int_view(new)).view(-1)
                    undo.append(partial(piece.write, idx, old[idx]))
                piece.write_all(new)
                continue
            flat = piece.np_piece()
            if flat is not None:
                try:
                    idx, old, old_sums, new_sums = apply_sparse_np(
                        flat, blob.numpy(), e.parts, e.index_codec or "", e.value_codec or "", e.count, e.num_changed)
                except (ValueError, RuntimeError, IndexError) as exc:
                    raise ChecksumError(f"{e.name}: undecodable sparse payload: {exc}") from exc
                # written already (one pass over the changed positions): a failed check below undoes it
                undo.append(partial(piece.write, idx, old.view(piece.dtype)))
                old_sum = cks.shift_sums(old_sums, e.shard, e.start)
                new_sum = cks.shift_sums(new_sums, e.shard, e.start)
                _check_delta_sums(e, old_sum, new_sum)
                continue
            try:
                idx, new, old = decode_sparse(blob, e.parts, e.index_codec or "", e.value_codec or "", e.count,
                                         e.num_changed, piece.read, piece.dtype)
            except (ValueError, RuntimeError, IndexError) as exc:
                raise ChecksumError(f"{e.name}: undecodable sparse payload: {exc}") from exc
            old = piece.read(idx) if old is None else old
            _check_delta_sums(e, cks.sparse_checksum(old, idx, e.shard, e.start),
                              cks.sparse_checksum(new, idx, e.shard, e.start))
            undo.append(partial(piece.write, idx, old))
            piece.write(idx, new)
        if verify == "full" or m.kind == "delta":  # a delta's pieces are checked whole, not only where it wrote
            for piece in pieces:
                e = piece.entry
                if cks.piece_checksum(piece.read_all(), e.shard, e.start) != e.checksum:
                    raise ChecksumError(f"{e.name}[{e.start}:{e.start + e.count}]: result checksum mismatch")
    except BaseException as exc:
        for restore in reversed(undo):
            restore()
        if isinstance(exc, WeightSyncError) or not isinstance(exc, Exception):
            raise
        raise WeightSyncError(f"applying update {m.version} failed: {exc}") from exc
    return m.version
