"""The receiver side: apply a full or delta update in place, all or nothing.

    planned  a full update laid out by sync.device: checked, then copied, on the
             device (ReceiverPlan); a delta over that layout: on the device too,
             when sync.codec.apply_planned_delta takes it
    phase 1  check, write nothing: version, names, shapes, offsets, payload
             checksums (raw pieces: the checksum of the values they carry)
    phase 2  write piece by piece, keeping the old values at the changed
             positions: sparse pieces through sync.codec.apply_pieces (on CPU
             the C kernels decode, write and sum all of them at once on the
             sync.pool threads); check that the old values sum to the base's
             there and base checksum + (new - old) equals the target checksum
    failure  write the kept old values back in reverse order and raise

Extra memory is one decoded piece (<= a bucket) plus, for a delta, the old
values at changed positions; a full update needs no undo log because phase 1
has already proved that its payload is the target.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import torch

from contracts.weights import Manifest, TensorEntry, WeightUpdate, bucket_tensor
from sync import checksum as cks
from sync import codec, device, pool
from sync.errors import BaseVersionMismatch, ChecksumError, ManifestMismatch, WeightSyncError
from sync.piece import Piece


def _blob(update: WeightUpdate, e: TensorEntry, buckets: dict[int, torch.Tensor]) -> torch.Tensor:
    if not 0 <= e.bucket < len(update.buckets):
        raise ManifestMismatch(f"{e.name}: bucket {e.bucket} does not exist")
    bucket = buckets.get(e.bucket)
    if bucket is None:  # resolve each (possibly remote) bucket once per apply
        bucket = buckets[e.bucket] = bucket_tensor(update.buckets[e.bucket])
    if e.offset < 0 or e.offset + e.nbytes > bucket.numel():
        raise ManifestMismatch(f"{e.name}: payload [{e.offset}, {e.offset + e.nbytes}) outside bucket {e.bucket}")
    return bucket[e.offset : e.offset + e.nbytes]


def _raw_values(blob: torch.Tensor, piece: Piece) -> torch.Tensor:
    e = piece.entry
    if e.nbytes != e.count * torch.empty(0, dtype=piece.dtype).element_size():
        raise ManifestMismatch(f"{e.name}: raw payload of {e.nbytes} bytes for {e.count} elements")
    if blob.data_ptr() % 8:  # a view must be aligned to the element size
        blob = blob.clone()
    return blob.view(piece.dtype)


def _promised(e: TensorEntry) -> cks.Checksum | None:
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


def _check_cpu_blob(piece: Piece, blob: torch.Tensor) -> None:
    e = piece.entry
    if e.encoding == "raw":
        _compare(e, cks.piece_checksum(_raw_values(blob, piece), e.shard, e.start))
    else:
        _compare(e, cks.bytes_checksum(blob))


def _device_payload_sums(items: list[tuple[Piece, torch.Tensor]]) -> list[torch.Tensor]:
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


def _check_payload(update: WeightUpdate, pieces: list[Piece], buckets: dict[int, torch.Tensor]) -> None:
    """Phase 1. CPU payloads are checked on the sync.pool threads (the numpy
    passes release the GIL), sparse ones summed together; device ones on this
    thread's stream, their sums read back together (one wait on the device per
    update)."""
    on_cpu: list[int | Callable[[], None]] = []  # a sparse piece's place in ``sparse``, or a raw piece's check
    cpu_sizes: list[int] = []
    on_device: list[tuple[Piece, torch.Tensor]] = []
    sparse: list[tuple[Piece, torch.Tensor]] = []
    for piece in pieces:
        blob = _blob(update, piece.entry, buckets)
        if blob.device.type != "cpu":
            on_device.append((piece, blob))
        elif piece.entry.encoding == "sparse":
            sparse.append((piece, blob))
            on_cpu.append(len(sparse) - 1)
        else:
            on_cpu.append(partial(_check_cpu_blob, piece, blob))
            cpu_sizes.append(piece.entry.count)
    for (piece, _), got in zip(on_device, cks.read_sums(_device_payload_sums(on_device))):
        _compare(piece.entry, got)
    sparse_sums = cks.bytes_checksums([blob for _, blob in sparse])
    done = iter(pool.run_each([c for c in on_cpu if not isinstance(c, int)], cpu_sizes))
    for c in on_cpu:  # the first bad piece in manifest order is the one reported
        if isinstance(c, int):
            _compare(sparse[c][0].entry, sparse_sums[c])
        elif isinstance(r := next(done), Exception):
            raise r


def _check_delta_sums(e: TensorEntry, old_sum: cks.Checksum, new_sum: cks.Checksum) -> None:
    """The receiver held the base values where the delta writes, and the
    delta takes the piece's checksum from base to target (O(changed) work)."""
    if old_sum != e.changed_base_checksum:
        raise ChecksumError(f"{e.name}[{e.start}:{e.start + e.count}]: receiver values differ from the base version")
    if e.base_checksum is None or cks.add(e.base_checksum, cks.sub(new_sum, old_sum)) != e.checksum:
        raise ChecksumError(f"{e.name}[{e.start}:{e.start + e.count}]: delta does not produce the target checksum")


_PLANS: dict[str, list[device.ReceiverPlan]] = {}  # layout -> checked plans (one per receiver in this process)


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


def stageable(manifest: Manifest) -> bool:
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
        del plans[device.MAX_PLANS:]
    return plan, region


def _plan_receiver(weights: dict[str, torch.Tensor], m: Manifest, region: torch.Tensor) -> device.ReceiverPlan | None:
    """Check a layout once: every piece raw, block-aligned, and a contiguous
    run of a receiver tensor of exactly its dtype on the buckets' device."""
    if device.layout_digest(m.entries, m.bucket_sizes) != m.layout:
        return None
    try:
        pieces = [Piece(weights, e) for e in m.entries]
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
    if m.layout and m.kind == "delta" and verify != "full" and codec.apply_planned_delta(weights, update):
        return m.version
    if len(update.buckets) != len(m.bucket_sizes):
        raise ManifestMismatch(f"{len(update.buckets)} buckets for a manifest of {len(m.bucket_sizes)}")
    pieces = [Piece(weights, e) for e in m.entries]
    buckets: dict[int, torch.Tensor] = {}
    _check_payload(update, pieces, buckets)

    undo: list[Callable[[], None]] = []  # each writes one piece's old values back
    try:
        _write(update, pieces, buckets, undo)
        if verify == "full" or m.kind == "delta":  # a delta's pieces are checked whole, not only where it wrote
            _verify(pieces)
    except BaseException as exc:
        for restore in reversed(undo):
            restore()
        if isinstance(exc, WeightSyncError) or not isinstance(exc, Exception):
            raise
        raise WeightSyncError(f"applying update {m.version} failed: {exc}") from exc
    return m.version


def _write(update: WeightUpdate, pieces: list[Piece], buckets: dict[int, torch.Tensor],
           undo: list[Callable[[], None]]) -> None:
    """Phase 2: every piece written, the old values it replaced on ``undo``
    first, and checked against the manifest as it is written."""
    sparse = [(p, _blob(update, p.entry, buckets)) for p in pieces if p.entry.encoding == "sparse"]
    for (piece, _), sums in zip(sparse, codec.apply_pieces(sparse, undo)):
        if isinstance(sums, Exception):
            raise sums
        _check_delta_sums(piece.entry, *sums)
    delta = update.manifest.kind == "delta"
    for piece in pieces:
        if piece.entry.encoding == "raw":
            _write_raw(piece, _blob(update, piece.entry, buckets).to(piece.device), delta, undo)


def _write_raw(piece: Piece, blob: torch.Tensor, delta: bool, undo: list[Callable[[], None]]) -> None:
    """A raw piece: of a delta, only over the base version (its old values kept where they change)."""
    e = piece.entry
    new = _raw_values(blob, piece)
    if delta:
        old = piece.read_all()
        if e.base_checksum is not None and cks.piece_checksum(old, e.shard, e.start) != e.base_checksum:
            raise ChecksumError(f"{e.name}: receiver values differ from the base version")
        idx = torch.nonzero(cks.int_view(old) != cks.int_view(new)).view(-1)
        undo.append(partial(piece.write, idx, old[idx]))
    piece.write_all(new)


def _verify(pieces: list[Piece]) -> None:
    """Every piece re-read whole and compared with its target checksum."""
    for piece in pieces:
        e = piece.entry
        if cks.piece_checksum(piece.read_all(), e.shard, e.start) != e.checksum:
            raise ChecksumError(f"{e.name}[{e.start}:{e.start + e.count}]: result checksum mismatch")
