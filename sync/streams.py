"""The byte streams of a sparse piece, in torch: the wire's definition.

Index streams (sorted changed positions within a piece of ``n`` elements):
  * ``varint``  — gaps minus one as LEB128 bytes: 1 byte per change while the
    mean gap is below 128 (density above ~1%), more only for the rare long gap;
  * ``bitmask`` — ``ceil(n / 8)`` bytes, bit ``i % 8`` of byte ``i // 8``; wins
    above ~12% density.
Value streams:
  * ``raw``   — the new values (element size each);
  * ``diff8`` — new minus old *bit pattern* as int8, with -128 escaping to a
    raw value in a third stream. An optimizer step at RL learning rates moves
    most changed bf16 elements by one unit in the last place, so this is
    1 byte per change; it is exact because the receiver holds the base.

A sparse blob is the index stream, the value stream and the escape stream, one
after the other (``TensorEntry.parts``: their sizes). This module is the
reference implementation, for any device and dtype; :mod:`sync.codec` decides
when the C kernels (:mod:`sync.native`) or the planned Triton kernels
(:mod:`sync.device_delta`) write the same bytes instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import torch

from sync.checksum import int_view

IndexCodec = Literal["varint", "bitmask"]
ValueCodec = Literal["raw", "diff8"]

ESCAPE = -128


def _count(mask: torch.Tensor) -> int:
    # torch's CPU bool sum is ~20x slower than numpy's count_nonzero
    if mask.is_cuda:
        return int(mask.sum())
    return int(np.count_nonzero(mask.numpy()))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


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
    """Inverse of :func:`varint_encode`; ``count`` positions expected. A stream
    that does not hold ``count`` values, or a value longer than 63 bits, raises
    ValueError."""
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
    if b.numel() and int(shift.max()) > 56:
        raise ValueError("varint value longer than 63 bits")
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
    if buf.numel() != (n + 7) // 8:
        raise ValueError(f"bitmask of {buf.numel()} bytes for {n} elements")
    if not buf.is_cuda:
        # 0/1 bytes viewed as bool: numpy's nonzero is ~4x faster on bool than on uint8
        mask = np.unpackbits(buf.numpy(), count=n, bitorder="little").view(bool)
        return torch.from_numpy(np.flatnonzero(mask))
    bits = (buf.view(-1, 1) >> torch.arange(8, device=buf.device, dtype=torch.uint8)) & 1
    return torch.nonzero(bits.view(-1)[:n]).view(-1)


# ---------------------------------------------------------------- values


def diff8_encode(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer views ``old``/``new`` at the changed positions -> (int8 diffs, raw escapes)."""
    d = new.to(torch.int64) - old.to(torch.int64)
    fits = (d > ESCAPE) & (d <= 127)
    d8 = torch.where(fits, d, ESCAPE).to(torch.int8)
    return d8, new[~fits]


def diff8_escapes(old: torch.Tensor, new: torch.Tensor) -> int:
    """How many of the changes :func:`diff8_encode` would escape."""
    d = new.to(torch.int64) - old.to(torch.int64)
    return d.numel() - _count((d > ESCAPE) & (d <= 127))


def diff8_decode(old: torch.Tensor, d8: torch.Tensor, escapes: torch.Tensor) -> torch.Tensor:
    """Integer view of the old values + diffs -> integer view of the new values."""
    esc = d8 == ESCAPE
    new = (old.to(torch.int64) + d8.to(torch.int64)).to(old.dtype)
    if escapes.numel() != _count(esc):
        raise ValueError("diff8 escape count does not match the escape stream")
    new[esc] = escapes
    return new


# ---------------------------------------------------------------- one piece


def pick_codecs(n: int, k: int, itemsize: int, index_sizes: dict[IndexCodec, int],
                num_escapes: int | None) -> tuple[IndexCodec, ValueCodec] | None:
    """The smallest encoding of ``k`` changes in a piece of ``n`` elements:
    (index codec, value codec), or None when a raw copy is no larger.
    ``index_sizes``: the bytes of each index stream available, ties going to
    the first; ``num_escapes``: diff8's escapes (None: diff8 not considered)."""
    sizes = dict(index_sizes)
    if not k * 8 < n:  # varint (>= 1 byte per change) cannot beat the bitmask
        sizes.pop("varint", None)
    index_codec: IndexCodec = min(sizes, key=sizes.__getitem__)
    values: dict[ValueCodec, int] = {"raw": k * itemsize}
    if num_escapes is not None and itemsize > 1:
        values["diff8"] = k + num_escapes * itemsize
    value_codec: ValueCodec = min(values, key=values.__getitem__)
    if k == 0 or sizes[index_codec] + values[value_codec] >= n * itemsize:
        return None
    return index_codec, value_codec


def encode_sparse(old: torch.Tensor, new: torch.Tensor, write_old: bool = False):
    """Compare 1-D pieces bit for bit, ``new`` cast to ``old.dtype`` first.

    Returns ``(idx, old_values, new_values, codecs, streams)``: the changed
    positions (int64), the values there (``old.dtype``), the codecs of
    :func:`pick_codecs` (None: a raw copy is no larger) and, for those codecs,
    the index, value and escape streams (uint8). ``write_old``: also make
    ``old`` equal to ``new`` (only the changed elements are written)."""
    new = new.to(old.dtype)
    oi, ni = int_view(old), int_view(new)
    idx = torch.nonzero(oi != ni).view(-1)
    k, n, size = idx.numel(), new.numel(), new.element_size()
    if k == 0:
        return idx, old[:0], new[:0], None, []
    old_c, new_c = oi[idx], ni[idx]
    if write_old:
        oi[idx] = new_c
    index_sizes: dict[IndexCodec, int] = {"varint": varint_size(idx)} if k * 8 < n else {}
    index_sizes["bitmask"] = (n + 7) // 8
    codecs = pick_codecs(n, k, size, index_sizes, diff8_escapes(old_c, new_c) if size > 1 else None)
    new_vals, old_vals = new_c.view(old.dtype), old_c.view(old.dtype)
    if codecs is None:
        return idx, old_vals, new_vals, None, []
    index_bytes = varint_encode(idx) if codecs[0] == "varint" else bitmask_encode(idx, n)
    if codecs[1] == "raw":
        streams = [index_bytes, as_bytes(new_c), index_bytes.new_empty(0)]
    else:
        d8, escapes = diff8_encode(old_c, new_c)
        streams = [index_bytes, as_bytes(d8), as_bytes(escapes)]
    return idx, old_vals, new_vals, codecs, streams


def decode_index(buf: torch.Tensor, index_codec: str, count: int, num_changed: int) -> torch.Tensor:
    """The int64 positions an index stream holds, checked against the manifest's counts."""
    if index_codec == "varint":
        idx = varint_decode(buf, num_changed)
    elif index_codec == "bitmask":
        idx = bitmask_decode(buf, count)
    else:
        raise ValueError(f"unknown index codec {index_codec!r}")
    if idx.numel() != num_changed or (num_changed and (int(idx[0]) < 0 or int(idx[-1]) >= count)):
        raise ValueError("decoded positions do not match the manifest")
    return idx


def decode_sparse(blob: torch.Tensor, parts: tuple[int, ...], index_codec: str, value_codec: str, count: int,
                  num_changed: int, old_values_at: Callable[[torch.Tensor], torch.Tensor],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode a sparse blob -> (positions within the piece, new values in
    ``dtype``, old values there or None). ``old_values_at(idx)`` returns the
    receiver's current values (read only for diff8, and then returned).
    A malformed blob raises ValueError (or RuntimeError from a misfit view)."""
    if len(parts) != 3 or sum(parts) != blob.numel():
        raise ValueError(f"sparse parts {parts} do not add up to {blob.numel()} bytes")
    a, b = parts[0], parts[0] + parts[1]
    idx = decode_index(blob[:a], index_codec, count, num_changed)
    int_dtype = int_view(torch.empty(0, dtype=dtype)).dtype
    old = None
    if value_codec == "raw":
        new = blob[a:b].clone().view(int_dtype)  # a copy: the slice may be misaligned for the dtype
    elif value_codec == "diff8":
        old = old_values_at(idx).to(dtype)
        new = diff8_decode(int_view(old), blob[a:b].clone().view(torch.int8), blob[b:].clone().view(int_dtype))
    else:
        raise ValueError(f"unknown value codec {value_codec!r}")
    if new.numel() != num_changed:
        raise ValueError("decoded values do not match the manifest")
    return idx, new.view(dtype), old
