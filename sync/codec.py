"""Per-piece delta codecs: which positions changed, and to what.

Index streams (sorted changed positions within a piece of ``n`` elements):
  * ``varint``  — gaps minus one as LEB128 bytes: 1 byte per change while the
    mean gap is below 128 (density above ~1%), more only for the rare long gap;
  * ``bitmask`` — ``ceil(n / 8)`` bytes; wins above ~12% density.
Value streams:
  * ``raw``   — the new values (element size each);
  * ``diff8`` — new minus old *bit pattern* as int8, with -128 escaping to a
    raw value in a third stream. An optimizer step at RL learning rates moves
    most changed bf16 elements by one unit in the last place, so this is
    1 byte per change; it is exact because the receiver holds the base.

On CPU the fused C kernels (:mod:`sync.native`) write these streams in one
pass; where they cannot be built, numpy (:mod:`sync.codec_np`); CUDA tensors
use torch on the device. All three write the same bytes.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import torch

from sync import codec_np as cnp
from sync import native
from sync.checksum import int_view

IndexCodec = Literal["varint", "bitmask"]
ValueCodec = Literal["raw", "diff8"]

_ESCAPE = -128


def _count(mask: torch.Tensor) -> int:
    # torch's CPU bool sum is ~20x slower than numpy's count_nonzero
    if mask.is_cuda:
        return int(mask.sum())
    return int(np.count_nonzero(mask.numpy()))


# ---------------------------------------------------------------- varint gaps


def _varint_lengths(values: torch.Tensor) -> torch.Tensor:
    n = torch.ones_like(values)
    for bits in (7, 14, 21, 28, 35, 42, 49, 56):
        n += values >= (1 << bits)
    return n


def varint_size(idx: torch.Tensor) -> int:
    """Bytes :func:`varint_encode` would produce for sorted ``idx``."""
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1
    return int(_varint_lengths(gaps).sum())


def varint_encode(idx: torch.Tensor) -> torch.Tensor:
    """Sorted distinct int64 positions -> LEB128 bytes of their gaps minus one."""
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1
    lengths = _varint_lengths(gaps)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    out = torch.empty(int(ends[-1]) if ends.numel() else 0, dtype=torch.uint8, device=idx.device)
    for b in range(int(lengths.max()) if lengths.numel() else 0):
        sel = lengths > b
        byte = (gaps[sel] >> (7 * b)) & 0x7F
        byte |= (lengths[sel] > b + 1).to(torch.int64) << 7
        out[starts[sel] + b] = byte.to(torch.uint8)
    return out


def varint_decode(buf: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`varint_encode`; ``count`` positions expected."""
    b = buf.to(torch.int64)
    is_end = (b & 0x80) == 0
    # group id of every byte = number of value ends strictly before it
    group = torch.cumsum(is_end, 0) - is_end.to(torch.int64)
    num_values = int(group[-1]) + 1 if b.numel() else 0
    if num_values != count or (b.numel() and not bool(is_end[-1])):
        raise ValueError("varint stream does not hold the expected number of values")
    end_pos = torch.nonzero(is_end).view(-1)
    group_start = torch.cat([end_pos.new_zeros(1), end_pos[:-1] + 1])
    shift = 7 * (torch.arange(b.numel(), device=b.device) - group_start[group])
    gaps = torch.zeros(count, dtype=torch.int64, device=b.device)
    gaps.scatter_add_(0, group, (b & 0x7F) << shift)
    return torch.cumsum(gaps + 1, 0) - 1


# ---------------------------------------------------------------- bitmask


def bitmask_encode(idx: torch.Tensor, n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool, device=idx.device)
    mask[idx] = True
    if not mask.is_cuda:
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    pad = (-n) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    out = torch.zeros(m.shape[0], dtype=torch.uint8, device=idx.device)
    for bit in range(8):
        out |= m[:, bit] << bit
    return out


def bitmask_decode(buf: torch.Tensor, n: int) -> torch.Tensor:
    if not buf.is_cuda:
        mask = np.unpackbits(buf.numpy(), count=n, bitorder="little")
        return torch.from_numpy(np.flatnonzero(mask))
    bits = (buf.view(-1, 1) >> torch.arange(8, device=buf.device, dtype=torch.uint8)) & 1
    return torch.nonzero(bits.view(-1)[:n]).view(-1)


# ---------------------------------------------------------------- values


def diff8_encode(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer views ``old``/``new`` at the changed positions -> (int8 diffs, raw escapes)."""
    d = new.to(torch.int64) - old.to(torch.int64)
    fits = (d > _ESCAPE) & (d <= 127)
    d8 = torch.where(fits, d, _ESCAPE).to(torch.int8)
    return d8, new[~fits]


def diff8_size(old: torch.Tensor, new: torch.Tensor) -> int:
    d = new.to(torch.int64) - old.to(torch.int64)
    num_escapes = d.numel() - _count((d > _ESCAPE) & (d <= 127))
    return d.numel() + num_escapes * new.element_size()


def diff8_decode(old: torch.Tensor, d8: torch.Tensor, escapes: torch.Tensor) -> torch.Tensor:
    """Integer view of the old values + diffs -> integer view of the new values."""
    esc = d8 == _ESCAPE
    new = (old.to(torch.int64) + d8.to(torch.int64)).to(old.dtype)
    if escapes.numel() != _count(esc):
        raise ValueError("diff8 escape count does not match the escape stream")
    new[esc] = escapes
    return new


# ---------------------------------------------------------------- one piece


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def encode_sparse(
    old: torch.Tensor, new: torch.Tensor, *, write_old: bool = False, scratch: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[IndexCodec, ValueCodec, list[torch.Tensor]] | None]:
    """Compare 1-D pieces bit for bit, ``new`` cast to ``old.dtype`` first.

    Returns ``(idx, old_values, new_values, plan, sums)`` (values at
    ``idx``, in ``old.dtype``) where ``plan`` is None when a
    raw copy of ``new`` is no larger than the best sparse encoding, else the
    chosen codecs and the byte streams (index, values, escapes); ``sums`` is
    ((sum, index-weighted sum) of the old values, the same of the new) when
    the CPU path computed them while comparing, else None.
    ``write_old``: also make ``old`` equal to ``new`` (only the changed
    elements are written). ``scratch``: a reusable buffer of ``old.dtype``
    for the cast, so a sync does not page-fault fresh memory every piece.
    """
    if new.is_cuda:
        return _encode_sparse_torch(old, new, write_old)
    return _encode_sparse_np(old, new, write_old, scratch)


def _encode_sparse_torch(old: torch.Tensor, new: torch.Tensor, write_old: bool = False):
    new = new.to(old.dtype)
    oi, ni = int_view(old), int_view(new)
    idx = torch.nonzero(oi != ni).view(-1)
    k, n, size = idx.numel(), new.numel(), new.element_size()
    if k == 0:
        return idx, old[:0], new[:0], None, None
    old_c, new_c = oi[idx], ni[idx]
    if write_old:
        oi[idx] = new_c
    idx_sizes = {"varint": varint_size(idx)} if k * 8 < n else {}
    idx_sizes["bitmask"] = (n + 7) // 8
    index_codec: IndexCodec = min(idx_sizes, key=idx_sizes.__getitem__)
    val_sizes = {"raw": k * size, "diff8": diff8_size(old_c, new_c) if size > 1 else k * size + 1}
    value_codec: ValueCodec = min(val_sizes, key=val_sizes.__getitem__)
    new_vals, old_vals = new_c.view(old.dtype), old_c.view(old.dtype)
    if idx_sizes[index_codec] + val_sizes[value_codec] >= n * size:
        return idx, old_vals, new_vals, None, None
    index_bytes = varint_encode(idx) if index_codec == "varint" else bitmask_encode(idx, n)
    if value_codec == "raw":
        streams = [index_bytes, as_bytes(new_c), index_bytes.new_empty(0)]
    else:
        d8, escapes = diff8_encode(old_c, new_c)
        streams = [index_bytes, as_bytes(d8), as_bytes(escapes)]
    return idx, old_vals, new_vals, (index_codec, value_codec, streams), None


class NativeChanges(NamedTuple):
    """:func:`encode_sparse_native`'s result. ``old_values`` is a view into the
    scratch (copy it to keep it); positions are not materialised: the index
    stream (the chosen codec's, or the bitmask for a raw piece) says them."""

    num_changed: int
    old_values: torch.Tensor
    plan: tuple[IndexCodec, ValueCodec, list[list[np.ndarray]]] | None
    sums: tuple[tuple[int, int], tuple[int, int]]
    index_codec: IndexCodec
    index_stream: list[np.ndarray]


def encode_sparse_native(old: torch.Tensor, new: torch.Tensor, *, write_old: bool,
                         scratch: "native.EncodeScratch", cast_buf: torch.Tensor | None = None) -> NativeChanges:
    """:func:`encode_sparse` through the fused kernel (CPU, 2- or 4-byte
    ``old``): one pass compares, emits every stream and sums, and (``write_old``)
    updates ``old``. ``new`` in another dtype is cast by the kernel (fp32 ->
    bf16) or into ``cast_buf`` first.
    Same codec choice and bytes as the numpy path."""
    if new.dtype != old.dtype and not native.fuses_cast(old, new):
        n = new.numel()
        buf = cast_buf[:n] if cast_buf is not None and cast_buf.dtype == old.dtype and cast_buf.numel() >= n \
            else torch.empty(n, dtype=old.dtype)
        buf.copy_(new)
        new = buf
    d = native.encode_piece(old, new.contiguous(), write_old, scratch)
    k, n, size = d.num_changed, old.numel(), old.element_size()
    # a copy (the scratch is reused): the sender's undo log keeps it
    olds = torch.from_numpy(np.concatenate(d.olds) if d.olds else np.empty(0, native._ELEM[size][1])).view(old.dtype)
    sums = (d.old_sums, d.new_sums)
    idx_sizes = dict(d.index_size)
    if not k * 8 < n:  # varint (>= 1 byte per change) cannot beat the bitmask
        idx_sizes.pop("varint", None)
    index_codec: IndexCodec = min(idx_sizes, key=idx_sizes.__getitem__)
    val_sizes = {"raw": k * size, "diff8": k + d.num_escapes * size}
    value_codec: ValueCodec = min(val_sizes, key=val_sizes.__getitem__)
    if k == 0 or idx_sizes[index_codec] + val_sizes[value_codec] >= n * size:
        return NativeChanges(k, olds, None, sums, "bitmask", d.index["bitmask"])
    u8 = lambda chunks: [c.view(np.uint8) for c in chunks]  # noqa: E731
    if value_codec == "raw":
        streams = [d.index[index_codec], u8(d.vals), []]
    else:
        streams = [d.index[index_codec], u8(d.d8), u8(d.esc)]
    return NativeChanges(k, olds, (index_codec, value_codec, streams), sums, index_codec, d.index[index_codec])


def _encode_sparse_np(old: torch.Tensor, new: torch.Tensor, write_old: bool = False,
                      scratch: torch.Tensor | None = None):
    """:func:`encode_sparse` for CPU tensors, in numpy. ``new`` may still be
    in the trainer's dtype: it is cast in one torch call per piece into
    ``scratch`` (torch's and numpy's threads then do not take turns per
    chunk), then compared a word at a time in cache-sized chunks."""
    if new.dtype != old.dtype:
        n = new.numel()
        buf = scratch[:n] if scratch is not None and scratch.dtype == old.dtype and scratch.numel() >= n \
            else torch.empty(n, dtype=old.dtype)
        buf.copy_(new)
        new = buf
    oi = int_view(old).numpy()
    found = cnp.find_changes(oi, int_view(new).numpy(), write_old)
    idx, old_c, new_c = found.idx, found.old, found.new
    sums = (found.old_sums, found.new_sums)
    k, n, size = idx.size, oi.size, oi.itemsize
    if k == 0:
        return torch.empty(0, dtype=torch.int64), old[:0], old[:0], None, sums
    idx_sizes = {}
    if k * 8 < n:  # otherwise varint (>= 1 byte per change) cannot beat the bitmask
        gaps = cnp.gaps_of(idx)
        plan = cnp.VarintPlan(gaps)
        idx_sizes["varint"] = plan.size
    idx_sizes["bitmask"] = (n + 7) // 8
    index_codec: IndexCodec = min(idx_sizes, key=idx_sizes.__getitem__)
    val_sizes = {"raw": k * size}
    if size > 1:
        val_sizes["diff8"] = k + found.num_escapes * size
    value_codec: ValueCodec = min(val_sizes, key=val_sizes.__getitem__)
    idx_t, new_vals = torch.from_numpy(idx), torch.from_numpy(new_c).view(old.dtype)
    old_vals = torch.from_numpy(old_c).view(old.dtype)
    if idx_sizes[index_codec] + val_sizes[value_codec] >= n * size:
        return idx_t, old_vals, new_vals, None, sums
    index_bytes = cnp.varint_encode(gaps, plan) if index_codec == "varint" else cnp.bitmask_encode(idx, n)
    if value_codec == "raw":
        streams = [index_bytes, new_c.view(np.uint8), np.empty(0, np.uint8)]
    else:
        escapes = new_c[found.d8 == cnp.ESCAPE] if found.num_escapes else new_c[:0]
        streams = [index_bytes, found.d8.view(np.uint8), escapes.view(np.uint8)]
    plan_out = (index_codec, value_codec, [torch.from_numpy(x) for x in streams])
    return idx_t, old_vals, new_vals, plan_out, sums


def decode_sparse(
    blob: torch.Tensor,
    parts: tuple[int, ...],
    index_codec: str,
    value_codec: str,
    count: int,
    num_changed: int,
    old_values_at: "callable",
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode a sparse blob -> (positions within the piece, new values in
    ``dtype``, old values there or None). ``old_values_at(idx)`` returns the
    receiver's current values (read only for diff8, and then returned)."""
    if len(parts) != 3 or sum(parts) != blob.numel():
        raise ValueError(f"sparse parts {parts} do not add up to {blob.numel()} bytes")
    a, b = parts[0], parts[0] + parts[1]
    if not blob.is_cuda:
        return _decode_sparse_np(blob.numpy(), a, b, index_codec, value_codec, count, num_changed, old_values_at, dtype)
    return _decode_sparse_torch(blob, a, b, index_codec, value_codec, count, num_changed, old_values_at, dtype)


def _decode_sparse_torch(blob: torch.Tensor, a: int, b: int, index_codec: str, value_codec: str, count: int,
                         num_changed: int, old_values_at: "callable", dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    idx_bytes, val_bytes, esc_bytes = blob[:a], blob[a:b], blob[b:]
    if index_codec == "varint":
        idx = varint_decode(idx_bytes, num_changed)
    elif index_codec == "bitmask":
        idx = bitmask_decode(idx_bytes, count)
    else:
        raise ValueError(f"unknown index codec {index_codec!r}")
    if idx.numel() != num_changed or (num_changed and (int(idx[0]) < 0 or int(idx[-1]) >= count)):
        raise ValueError("decoded positions do not match the manifest")
    int_dtype = int_view(torch.empty(0, dtype=dtype)).dtype
    old_t = None
    if value_codec == "raw":
        new = val_bytes.clone().view(int_dtype)
    elif value_codec == "diff8":
        old_t = old_values_at(idx).to(dtype)
        new = diff8_decode(int_view(old_t), val_bytes.clone().view(torch.int8), esc_bytes.clone().view(int_dtype))
    else:
        raise ValueError(f"unknown value codec {value_codec!r}")
    if new.numel() != num_changed:
        raise ValueError("decoded values do not match the manifest")
    return idx, new.view(dtype), old_t


def _decode_sparse_np(blob: np.ndarray, a: int, b: int, index_codec: str, value_codec: str, count: int,
                      num_changed: int, old_values_at: "callable", dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    idx = _decode_index_np(blob[:a], index_codec, count, num_changed)
    int_dtype = int_view(torch.empty(0, dtype=dtype)).numpy().dtype
    idx_t = torch.from_numpy(idx)
    old_t = None
    if value_codec == "raw":
        new = blob[a:b].copy().view(int_dtype)  # copy: the slice may be misaligned for the dtype
    elif value_codec == "diff8":
        old_t = old_values_at(idx_t).to(dtype)
        new = cnp.diff8_decode(int_view(old_t).numpy(), blob[a:b].view(np.int8), blob[b:].copy().view(int_dtype))
    else:
        raise ValueError(f"unknown value codec {value_codec!r}")
    if new.size != num_changed:
        raise ValueError("decoded values do not match the manifest")
    return idx_t, torch.from_numpy(new).view(dtype), old_t


def apply_sparse_np(flat: np.ndarray, blob: np.ndarray, parts: tuple[int, ...], index_codec: str, value_codec: str,
                    count: int, num_changed: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], tuple[int, int]]:
    """Decode a sparse blob and write it into ``flat`` (the integer view of
    one contiguous CPU piece) in a single pass over the changed positions.
    Returns (positions, old values, sum pair of the old values, of the new)
    for the caller to check against the manifest, writing the old values
    back (:func:`restore_np`) if they do not match."""
    if len(parts) != 3 or sum(parts) != blob.size:
        raise ValueError(f"sparse parts {parts} do not add up to {blob.size} bytes")
    a, b = parts[0], parts[0] + parts[1]
    idx = _decode_index_np(blob[:a], index_codec, count, num_changed)
    if value_codec == "raw":
        old, old_sums, new_sums = cnp.apply_changes(flat, idx, values=blob[a:b].copy().view(flat.dtype))
    elif value_codec == "diff8":
        old, old_sums, new_sums = cnp.apply_changes(flat, idx, d8=blob[a:b].view(np.int8),
                                                    escapes=blob[b:].copy().view(flat.dtype))
    else:
        raise ValueError(f"unknown value codec {value_codec!r}")
    return torch.from_numpy(idx), torch.from_numpy(old), old_sums, new_sums


def _decode_index_np(buf: np.ndarray, index_codec: str, count: int, num_changed: int) -> np.ndarray:
    if index_codec == "varint":
        idx = cnp.varint_decode(buf, num_changed)
    elif index_codec == "bitmask":
        idx = cnp.bitmask_decode(buf, count)
    else:
        raise ValueError(f"unknown index codec {index_codec!r}")
    if idx.size != num_changed or (num_changed and (int(idx[0]) < 0 or int(idx[-1]) >= count)):
        raise ValueError("decoded positions do not match the manifest")
    return idx
