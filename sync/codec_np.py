"""NumPy versions of the :mod:`sync.codec` streams, used for CPU tensors.

Same bytes as the torch versions (tested against each other); numpy's
integer ufuncs and fancy indexing are several times faster than torch's on
CPU for the int64 gap arithmetic these need.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ESCAPE = -128


def gaps_of(idx: np.ndarray) -> np.ndarray:
    """Sorted distinct positions -> gaps minus one (all >= 0)."""
    gaps = np.diff(idx, prepend=-1)
    gaps -= 1
    return gaps


class VarintPlan:
    """Where the multi-byte gaps are. Most gaps are below 128 and take one
    byte; only the few long ones are worked on separately."""

    __slots__ = ("big", "big_len", "size")

    def __init__(self, gaps: np.ndarray) -> None:
        self.big = np.flatnonzero(gaps >= 128)
        g = gaps[self.big]
        self.big_len = np.ones(self.big.size, dtype=np.int64)
        for bits in range(7, 63, 7):
            more = g >= (1 << bits)
            if not more.any():
                break
            self.big_len += more
        self.size = gaps.size + int(self.big_len.sum()) - self.big.size


def varint_encode(gaps: np.ndarray, plan: VarintPlan) -> np.ndarray:
    low = gaps.astype(np.uint8)
    if plan.big.size == 0:
        return low
    low &= 0x7F
    reps = np.ones(gaps.size, dtype=np.intp)
    reps[plan.big] = plan.big_len
    out = np.repeat(low, reps)  # long gaps get their extra bytes right after their first
    extra = plan.big_len - 1
    starts = plan.big + np.cumsum(extra) - extra
    g = gaps[plan.big]
    for b in range(1, int(plan.big_len.max())):
        sel = plan.big_len > b
        out[starts[sel] + b - 1] |= 0x80
        out[starts[sel] + b] = (g[sel] >> (7 * b)) & 0x7F
    return out


def varint_decode(buf: np.ndarray, count: int) -> np.ndarray:
    if buf.size == count:  # every gap took one byte
        if count and int(buf.max()) >= 0x80:
            raise ValueError("varint stream does not hold the expected number of values")
        gaps = buf.astype(np.int64)
    else:
        is_end = (buf & 0x80) == 0
        end_pos = np.flatnonzero(is_end)
        if end_pos.size != count or (buf.size and not is_end[-1]):
            raise ValueError("varint stream does not hold the expected number of values")
        starts = np.empty_like(end_pos)
        starts[0] = 0
        starts[1:] = end_pos[:-1] + 1
        lengths = end_pos - starts + 1
        if int(lengths.max()) > 9:
            raise ValueError("varint value longer than 63 bits")
        gaps = (buf[starts] & 0x7F).astype(np.int64)
        for k in range(1, int(lengths.max())):
            sel = np.flatnonzero(lengths > k)
            gaps[sel] |= (buf[starts[sel] + k] & 0x7F).astype(np.int64) << (7 * k)
    gaps += 1
    return np.cumsum(gaps) - 1


def bitmask_encode(idx: np.ndarray, n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[idx] = True
    return np.packbits(mask, bitorder="little")


def bitmask_decode(buf: np.ndarray, n: int) -> np.ndarray:
    if buf.size != (n + 7) // 8:
        raise ValueError(f"bitmask of {buf.size} bytes for {n} elements")
    # 0/1 bytes viewed as bool: numpy's nonzero is ~4x faster on bool than on uint8
    return np.flatnonzero(np.unpackbits(buf, count=n, bitorder="little").view(bool))


def diff8(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 diffs with ESCAPE where a diff does not fit, fits mask)."""
    wide = np.int32 if old.itemsize <= 2 else np.int64
    d = new.astype(wide)
    d -= old
    fits = (d > ESCAPE) & (d <= 127)
    d8 = d.astype(np.int8)
    d8[~fits] = ESCAPE
    return d8, fits


def diff8_decode(old: np.ndarray, d8: np.ndarray, escapes: np.ndarray) -> np.ndarray:
    wide = np.int32 if old.itemsize <= 2 else np.int64
    esc = d8 == ESCAPE
    if escapes.size != int(np.count_nonzero(esc)):
        raise ValueError("diff8 escape count does not match the escape stream")
    new = (old.astype(wide) + d8).astype(old.dtype)
    new[esc] = escapes
    return new


# ---------------------------------------------------------------- finding changes

COMPARE_CHUNK = 1 << 18  # elements per compare task: both sides and the mask stay in L2
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _compare_pool() -> ThreadPoolExecutor:
    """One process-wide pool (numpy's compares release the GIL), made on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sync-compare")
        return _pool


def _changes_in(old: np.ndarray, new: np.ndarray, base: int, write_old: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Changed positions (+ ``base``), old and new values of one chunk. Compared
    a machine word (4 bf16 / 2 fp32 lanes) at a time: with a few percent of
    elements changed most words are equal, and the lanes of the rest are
    split out from the gathered words, which are already in cache."""
    lanes = 8 // old.itemsize
    num_words = old.size // lanes if lanes > 1 and old.ctypes.data % 8 == 0 and new.ctypes.data % 8 == 0 else 0
    parts = []
    if num_words:
        main = num_words * lanes
        ow, nw = old[:main].view(np.int64), new[:main].view(np.int64)
        w = np.flatnonzero(ow != nw)
        a, b = ow[w].view(old.dtype), nw[w].view(old.dtype)
        j = np.flatnonzero(a != b)
        parts.append((w[j // lanes] * lanes + (j % lanes), a[j], b[j]))
        if write_old:
            ow[w] = nw[w]  # whole words: their unchanged lanes are equal anyway
    if num_words * lanes < old.size:
        o, n = old[num_words * lanes :], new[num_words * lanes :]
        j = np.flatnonzero(o != n)
        parts.append((j + num_words * lanes, o[j], n[j]))
        if write_old:
            o[j] = n[j]
    if not parts:  # an empty piece
        return np.empty(0, np.int64), old[:0].copy(), new[:0].copy()
    if len(parts) == 1:
        idx, o_vals, n_vals = parts[0]
    else:
        idx, o_vals, n_vals = (np.concatenate(x) for x in zip(*parts))
    idx += base
    return idx, o_vals, n_vals


def find_changes(old: np.ndarray, new: np.ndarray, write_old: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bit-exact compare of two integer views of one piece: (sorted int64
    positions, old values there, new values there). ``write_old`` also
    writes the new values into ``old`` while each chunk is in cache (the
    sender's last-sent copy), instead of a scatter over the piece later."""
    assert old.shape == new.shape and old.dtype == new.dtype and old.ndim == 1
    starts = range(0, old.size, COMPARE_CHUNK)
    if len(starts) <= 1:
        return _changes_in(old, new, 0, write_old)

    def one(s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _changes_in(old[s : s + COMPARE_CHUNK], new[s : s + COMPARE_CHUNK], s, write_old)

    parts = list(_compare_pool().map(one, starts))
    return tuple(np.concatenate(x) for x in zip(*parts))  # type: ignore[return-value]
