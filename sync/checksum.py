"""Position-weighted additive checksums, exact on CPU and GPU alike.

For a piece whose elements (read as integers of their own width) are ``x_j``
at flat positions ``p_j`` of the full tensor::

    checksum = (sum_j x_j, sum_j (p_j + 1) * x_j)   both mod 2**64

Why not CRC: this sum is additive, so (a) the checksum of a tensor is the
sum over its pieces however a sharded trainer cut it, and (b) a delta's
effect on it costs O(changed elements), which is what keeps a delta sync
small in *time*, not just bytes. Integer sums are exact and independent of
reduction order, so CPU (numpy; the C kernels of :mod:`sync.native`
for byte payloads) and GPU (torch) agree bit for bit.
Any single changed element changes the first sum; swaps change the second.
"""

from __future__ import annotations

import numpy as np
import torch

from sync import native
from contracts.weights import Checksum, ShardSpec

MASK64 = (1 << 64) - 1
_BLOCK = 4096  # row length for the (row sum, column sum) trick below
_ROWS_PER_PASS = 64  # 64 x 4096 x 2 bytes: stays in L2 between the two sums

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(values: torch.Tensor) -> torch.Tensor:
    """The same bytes read as integers of the element width (1-D contiguous)."""
    return values.reshape(-1).view(_INT_VIEW[values.element_size()])


def add(a: Checksum, b: Checksum) -> Checksum:
    return ((a[0] + b[0]) & MASK64, (a[1] + b[1]) & MASK64)


def _weighted_np(a: np.ndarray) -> tuple[int, int]:
    """(sum x_j, sum j * x_j) for j = 0..n-1, wrapping int64 arithmetic."""
    n = a.shape[0]
    rows_n = n // _BLOCK
    s0 = s1 = 0
    if rows_n:
        main = a[: rows_n * _BLOCK].reshape(rows_n, _BLOCK)
        rows = np.empty(rows_n, dtype=np.int64)
        cols = np.zeros(_BLOCK, dtype=np.int64)
        for r in range(0, rows_n, _ROWS_PER_PASS):  # both sums while the rows are in cache
            block = main[r : r + _ROWS_PER_PASS]
            block.sum(axis=1, dtype=np.int64, out=rows[r : r + _ROWS_PER_PASS])
            cols += block.sum(axis=0, dtype=np.int64)
        s0 += int(rows.sum(dtype=np.int64))
        # sum over (r, c) of (r*B + c) * x[r, c] = B * sum_r r*rows[r] + sum_c c*cols[c]
        s1 += _BLOCK * int((rows * np.arange(rows_n, dtype=np.int64)).sum(dtype=np.int64))
        s1 += int((cols * np.arange(_BLOCK, dtype=np.int64)).sum(dtype=np.int64))
    tail = a[rows_n * _BLOCK :].astype(np.int64)
    if tail.shape[0]:
        s0 += int(tail.sum(dtype=np.int64))
        s1 += int((tail * np.arange(rows_n * _BLOCK, n, dtype=np.int64)).sum(dtype=np.int64))
    return s0, s1


def _dot_torch(x: torch.Tensor, idx: torch.Tensor) -> tuple[int, int]:
    """(sum x, sum idx * x) with wrapping int64 arithmetic."""
    x = x.to(torch.int64)
    return int(x.sum()), int((x * idx.to(device=x.device, dtype=torch.int64)).sum())


def _weighted_torch(x: torch.Tensor, first_pos: int = 0) -> torch.Tensor:
    """int64[2] on x's device: (sum x, sum (first_pos + j) * x), wrapping; not read back."""
    x = x.to(torch.int64)
    pos = torch.arange(first_pos, first_pos + x.shape[0], dtype=torch.int64, device=x.device)
    return torch.stack((x.sum(), (x * pos).sum()))


def read_sums(sums: list[torch.Tensor]) -> list[Checksum]:
    """Checksums from the device: every pending (sum, weighted sum) pair in
    one copy to the host, so a sync of many pieces waits on the device once."""
    if not sums:
        return []
    flat = torch.stack(sums).tolist()
    return [(a & MASK64, b & MASK64) for a, b in flat]


def region_sums(values: torch.Tensor, first_pos: int) -> torch.Tensor:
    """:func:`region_checksum` of device values, left on the device (see :func:`read_sums`)."""
    return _weighted_torch(int_view(values.contiguous()), first_pos + 1)


def region_checksum(values: torch.Tensor, first_pos: int) -> Checksum:
    """Checksum of a 1-D run of values at flat positions ``first_pos, first_pos+1, ...``."""
    x = int_view(values.contiguous())
    if x.is_cuda:
        return read_sums([_weighted_torch(x, first_pos + 1)])[0]
    s0, sj = _weighted_np(x.numpy())
    return (s0 & MASK64, ((first_pos + 1) * s0 + sj) & MASK64)


def _np_weighted(x: np.ndarray, p: np.ndarray) -> Checksum:
    x = x.astype(np.int64)
    s0 = int(x.sum(dtype=np.int64))
    p = p + 1
    p *= x  # wraps mod 2**64 like the torch path
    return s0 & MASK64, int(p.sum(dtype=np.int64)) & MASK64


def positions_checksum(values: torch.Tensor, positions: torch.Tensor) -> Checksum:
    """Checksum of values at arbitrary flat ``positions`` (int64, same length)."""
    if not values.is_cuda:
        return _np_weighted(int_view(values.contiguous()).numpy(), positions.cpu().to(torch.int64).numpy())
    return read_sums([positions_sums(values, positions)])[0]


def positions_sums(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`positions_checksum` of device values, left on the device (see :func:`read_sums`)."""
    x = int_view(values.contiguous()).to(torch.int64)
    p = positions.to(device=x.device, dtype=torch.int64)
    return torch.stack((x.sum(), (x * (p + 1)).sum()))


def delta_checksum(old: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> Checksum:
    """How the checksum moves when the values at ``positions`` go from ``old``
    to ``new`` (integer views or same-dtype float tensors)."""
    o = old if not old.is_floating_point() else int_view(old)
    n = new if not new.is_floating_point() else int_view(new)
    if not n.is_cuda:
        d_np = n.contiguous().numpy().astype(np.int64)
        d_np -= o.contiguous().numpy()
        return _np_weighted(d_np, positions.cpu().to(torch.int64).numpy())
    d = n.to(torch.int64) - o.to(torch.int64)
    p = positions.to(device=d.device, dtype=torch.int64)
    return int(d.sum()) & MASK64, int((d * (p + 1)).sum()) & MASK64


def _bytes_regions(buf: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    buf = buf.view(torch.uint8).reshape(-1)
    num_main = buf.numel() // 8 * 8
    main = buf[:num_main]
    if main.data_ptr() % 8:
        main = main.clone()
    regions = [(main.view(torch.int64), 0)] if num_main else []
    if num_main < buf.numel():
        regions.append((buf[num_main:], num_main // 8))
    return regions


def bytes_checksum(buf: torch.Tensor) -> Checksum:
    """Checksum of a uint8 buffer read as little-endian 8-byte words
    (positions are word indices), then its last ``len % 8`` bytes at the
    following positions: a sparse payload is checked at 8 bytes per step."""
    if buf.is_cuda:
        return read_sums([bytes_sums(buf)])[0]
    flat = buf.view(torch.uint8).reshape(-1)
    if native.available():
        return native.bytes_sums(flat.numpy())
    total = (0, 0)
    for region, first in _bytes_regions(buf):
        total = add(total, region_checksum(region, first))
    return total


def bytes_checksums(bufs: list[torch.Tensor]) -> list[Checksum]:
    """:func:`bytes_checksum` of many 1-D contiguous uint8 CPU buffers: with the
    C kernels a few calls in all (a call per small sparse payload cost more
    than summing it), else one each."""
    if bufs and native.available():
        return native.bytes_sums_many(bufs)
    return [bytes_checksum(b) for b in bufs]


def bytes_sums(buf: torch.Tensor) -> torch.Tensor:
    """:func:`bytes_checksum` of a device buffer, left on the device (int64 sums wrap alike)."""
    regions = _bytes_regions(buf)
    if not regions:
        return torch.zeros(2, dtype=torch.int64, device=buf.device)
    sums = [region_sums(region, first) for region, first in regions]
    return sums[0] if len(sums) == 1 else sums[0] + sums[1]


def piece_positions(shard: ShardSpec | None, local_idx: torch.Tensor) -> torch.Tensor:
    """Flat positions in the full tensor of shard-local flat indices."""
    if shard is None:
        return local_idx
    if shard.is_contiguous:
        return local_idx + shard.global_start
    return shard.global_positions(local_idx)


def piece_sums(values: torch.Tensor, shard: ShardSpec | None, start: int) -> torch.Tensor:
    """:func:`piece_checksum` of device values, left on the device (see :func:`read_sums`)."""
    if shard is None or shard.is_contiguous:
        return region_sums(values, start + (shard.global_start if shard is not None else 0))
    local = torch.arange(start, start + values.numel(), dtype=torch.int64, device=values.device)
    return positions_sums(values, shard.global_positions(local))


_GROUP_ELEMS = 1 << 22  # pieces summed together up to this many elements (int64 temporaries of 32 MiB)


def pieces_sums(items: list[tuple[torch.Tensor, ShardSpec | None, int]]) -> list[torch.Tensor]:
    """:func:`piece_sums` of many ``(values, shard, start)`` pieces, in few kernels.

    Small pieces contiguous in their full tensor are summed together, one
    segmented pass per group of up to ``_GROUP_ELEMS`` elements: a model of many
    small tensors otherwise pays ~6 kernel launches per piece on each side of a
    sync. Large and strided-shard pieces take :func:`piece_sums` alone."""
    out: list[torch.Tensor | None] = [None] * len(items)
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor, int]]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}  # elements per open group

    def flush(key: tuple[torch.device, torch.dtype]) -> None:
        group = groups.pop(key)
        del sizes[key]
        sums = _segment_sums([x for _, x, _ in group], [first for _, _, first in group])
        for row, (i, _, _) in enumerate(group):
            out[i] = sums[row]

    for i, (values, shard, start) in enumerate(items):
        if (shard is not None and not shard.is_contiguous) or values.numel() >= _GROUP_ELEMS:
            out[i] = piece_sums(values, shard, start)
            continue
        x = int_view(values.contiguous())
        key = (x.device, x.dtype)
        groups.setdefault(key, []).append((i, x, start + (shard.global_start if shard is not None else 0) + 1))
        sizes[key] = sizes.get(key, 0) + x.numel()
        if sizes[key] >= _GROUP_ELEMS:
            flush(key)
    for key in list(groups):
        flush(key)
    return out  # type: ignore[return-value]


def _segment_sums(xs: list[torch.Tensor], firsts: list[int]) -> torch.Tensor:
    """int64 [P, 2]: per piece p, (sum x, sum (firsts[p] + j) * x_j), wrapping like :func:`_weighted_torch`.

    Prefix sums, not a scatter: with g the element's index in the group and
    ``start[p]`` its piece's first, ``sum (firsts[p] + j) x_j = sum g x_g +
    (firsts[p] - start[p]) sum x_g``, and each piece's sums are differences of the
    prefix sums of ``x`` and ``g x`` at its ends (an int64 ``index_add_`` of the
    same was an order of magnitude slower than the scan)."""
    device, n = xs[0].device, sum(x.numel() for x in xs)
    x = torch.cat(xs).to(torch.int64)
    ends, shift, offset = [], [], 0
    for piece, first in zip(xs, firsts):
        shift.append(first - offset)
        offset += piece.numel()
        ends.append(offset)
    host = torch.tensor([[0, *ends[:-1]], ends, shift], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    starts_d, ends_d, shift_d = host.to(device, non_blocking=True)
    prefix = torch.zeros(2, n + 1, dtype=torch.int64, device=device)
    torch.cumsum(x, 0, out=prefix[0, 1:])
    torch.cumsum(x.mul_(torch.arange(n, dtype=torch.int64, device=device)), 0, out=prefix[1, 1:])
    sums = prefix[:, ends_d] - prefix[:, starts_d]  # [2, P]: sum x, sum g x
    return torch.stack((sums[0], sums[1] + shift_d * sums[0]), dim=1)


def piece_checksum(values: torch.Tensor, shard: ShardSpec | None, start: int) -> Checksum:
    """Checksum of a piece: ``values`` at shard-local flat range starting at ``start``."""
    if values.is_cuda:
        return read_sums([piece_sums(values, shard, start)])[0]
    if shard is None:
        return region_checksum(values, start)
    if shard.is_contiguous:
        return region_checksum(values, shard.global_start + start)
    local = torch.arange(start, start + values.numel(), dtype=torch.int64, device=values.device)
    return positions_checksum(values, shard.global_positions(local))


def sub(a: Checksum, b: Checksum) -> Checksum:
    return ((a[0] - b[0]) & MASK64, (a[1] - b[1]) & MASK64)


def shift_sums(sums: tuple[int, int], shard: ShardSpec | None, start: int) -> Checksum:
    """Checksum from (sum x, sum local_idx * x) over piece-local indices of
    a piece starting at shard-local ``start`` (contiguous in the full tensor)."""
    assert shard is None or shard.is_contiguous
    s0, sj = sums
    offset = start + (shard.global_start if shard is not None else 0)
    return s0 & MASK64, ((offset + 1) * s0 + sj) & MASK64


def sparse_checksum(values: torch.Tensor, local_idx: torch.Tensor, shard: ShardSpec | None, start: int) -> Checksum:
    """Checksum of ``values`` at piece-local indices ``local_idx`` (sorted or
    not) of the piece starting at shard-local ``start``. For pieces contiguous
    in the full tensor this is one dot product, no position array."""
    if shard is not None and not shard.is_contiguous:
        return positions_checksum(values, shard.global_positions(local_idx.to(torch.int64) + start))
    offset = start + (shard.global_start if shard is not None else 0)
    if values.is_cuda:
        s0, sj = _dot_torch(int_view(values.contiguous()), local_idx)
    else:
        x = int_view(values.contiguous()).numpy().astype(np.int64)
        s0 = int(x.sum(dtype=np.int64))
        sj = int(np.dot(x, local_idx.numpy().astype(np.int64, copy=False)))
    return s0 & MASK64, ((offset + 1) * s0 + sj) & MASK64
