"""NumPy versions of the :mod:`sync.codec` streams, used for CPU tensors.

Same bytes as the torch versions (tested against each other); numpy's
integer ufuncs and fancy indexing are several times faster than torch's on
CPU for the int64 gap arithmetic these need.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

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
    big, length = plan.big, plan.big_len
    g = gaps[big]
    extra = length - 1
    before = np.cumsum(extra) - extra  # extra bytes of the long gaps before each one
    # byte b >= 1 of each long gap, and where it lands: right after its first byte
    b = np.arange(int(extra.sum())) - np.repeat(before, extra) + 1
    at = np.repeat(big + before, extra) + b
    keep = np.ones(plan.size, dtype=bool)
    keep[at] = False
    low[big] = (g & 0x7F) | 0x80
    out = np.empty(plan.size, dtype=np.uint8)
    out[keep] = low  # one pass; the few extra bytes go in after
    more = b + 1 < np.repeat(length, extra)
    out[at] = ((np.repeat(g, extra) >> (7 * b)) & 0x7F) | (more.astype(np.int64) << 7)
    return out


def varint_decode(buf: np.ndarray, count: int) -> np.ndarray:
    """Inverse of :func:`varint_encode`. Only the few multi-byte gaps are
    handled element-wise: a byte's gap index is its position minus the
    number of continuation bytes before it, so the continuation bytes alone
    say where every extra 7 bits go."""
    cont = np.flatnonzero(buf >= 0x80)
    if buf.size - cont.size != count or (buf.size and buf[-1] >= 0x80):
        raise ValueError("varint stream does not hold the expected number of values")
    if cont.size == 0:  # every gap took one byte
        gaps = buf.astype(np.int64)
    else:
        run_start = np.ones(cont.size, dtype=bool)
        np.not_equal(cont[1:], cont[:-1] + 1, out=run_start[1:])
        starts = np.flatnonzero(run_start)
        run_len = np.diff(np.append(starts, cont.size))
        if int(run_len.max()) > 8:
            raise ValueError("varint value longer than 63 bits")
        pos_in_run = np.arange(cont.size) - np.repeat(starts, run_len)
        group = cont - np.arange(cont.size)  # the gap each continuation byte belongs to
        gaps = np.delete(buf, cont + 1).astype(np.int64)  # the first byte of every gap
        gaps[group[starts]] &= 0x7F
        extra = (buf[cont + 1] & 0x7F).astype(np.int64) << (7 * (pos_in_run + 1))
        np.add.at(gaps, group, extra)  # disjoint bit ranges: + is |
    gaps += 1
    np.cumsum(gaps, out=gaps)
    gaps -= 1
    return gaps


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

_MASK64 = (1 << 64) - 1
COMPARE_CHUNK = 1 << 18  # elements per compare task: both sides and the mask stay in L2
# Threads for compare/apply chunks (numpy releases the GIL in its loops). Default 1 runs
# them inline: on the shared 2-core bench host a 2-thread pool made the delta encode of
# a 0.5B model ~1.5x slower than inline chunks (GIL hand-offs between many small ops,
# torch's worker threads spinning). Set ASYNCRL_SYNC_THREADS on hosts with idle cores.
NUM_THREADS = max(1, int(os.environ.get("ASYNCRL_SYNC_THREADS", "1")))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _map(fn, items):
    """``list(map(fn, items))``, on the process-wide pool when it has more than one thread."""
    global _pool
    if NUM_THREADS <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=NUM_THREADS, thread_name_prefix="sync-compare")
    return list(_pool.map(fn, items))


def _sums(x: np.ndarray, idx: np.ndarray) -> tuple[int, int]:
    """(sum x, sum idx * x) mod 2**64 (numpy's int64 arithmetic wraps)."""
    x = x.astype(np.int64)
    return int(x.sum(dtype=np.int64)) & _MASK64, int(np.dot(x, idx)) & _MASK64


class Found(NamedTuple):
    """What changed in a piece: sorted int64 positions, old and new values
    there, (sum, index-weighted sum) of each, and the diff8 value stream
    (None for 1-byte elements) with its number of escapes."""

    idx: np.ndarray
    old: np.ndarray
    new: np.ndarray
    old_sums: tuple[int, int]
    new_sums: tuple[int, int]
    d8: np.ndarray | None
    num_escapes: int


def _changes_in(old: np.ndarray, new: np.ndarray, base: int, write_old: bool) -> Found:
    """What changed in one chunk (positions + ``base``). Compared a machine
    word (4 bf16 / 2 fp32 lanes) at a time: with a few percent of elements
    changed most words are equal, and the lanes of the rest are split out
    from the gathered words, which are already in cache. The sums and diff8
    stream are made here too, while the changed values are in cache."""
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
        idx, o_vals, n_vals = np.empty(0, np.int64), old[:0].copy(), new[:0].copy()
    elif len(parts) == 1:
        idx, o_vals, n_vals = parts[0]
    else:
        idx, o_vals, n_vals = (np.concatenate(x) for x in zip(*parts))
    idx += base
    d8, num_escapes = None, 0
    if old.itemsize > 1:
        d8, fits = diff8(o_vals, n_vals)
        num_escapes = idx.size - int(np.count_nonzero(fits))
    return Found(idx, o_vals, n_vals, _sums(o_vals, idx), _sums(n_vals, idx), d8, num_escapes)


def find_changes(old: np.ndarray, new: np.ndarray, write_old: bool = False) -> Found:
    """Bit-exact compare of two integer views of one piece. ``write_old``
    also writes the new values into ``old`` while each chunk is in cache
    (the sender's last-sent copy), instead of a scatter over the piece later.
    Chunks run inline, or on the pool when ``NUM_THREADS`` > 1."""
    assert old.shape == new.shape and old.dtype == new.dtype and old.ndim == 1
    starts = range(0, old.size, COMPARE_CHUNK)
    if len(starts) <= 1:
        return _changes_in(old, new, 0, write_old)

    def one(s: int) -> Found:
        return _changes_in(old[s : s + COMPARE_CHUNK], new[s : s + COMPARE_CHUNK], s, write_old)

    parts = _map(one, starts)
    mask = (1 << 64) - 1
    return Found(
        np.concatenate([p.idx for p in parts]), np.concatenate([p.old for p in parts]),
        np.concatenate([p.new for p in parts]),
        (sum(p.old_sums[0] for p in parts) & mask, sum(p.old_sums[1] for p in parts) & mask),
        (sum(p.new_sums[0] for p in parts) & mask, sum(p.new_sums[1] for p in parts) & mask),
        None if parts[0].d8 is None else np.concatenate([p.d8 for p in parts]),
        sum(p.num_escapes for p in parts),
    )


# ---------------------------------------------------------------- applying changes

APPLY_CHUNK = 1 << 16  # changed elements per apply task: their cache lines are read and written once


def apply_changes(flat: np.ndarray, idx: np.ndarray, values: np.ndarray | None = None,
                  d8: np.ndarray | None = None, escapes: np.ndarray | None = None) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """Write new values at sorted positions ``idx`` of the integer view
    ``flat`` and return (old values there, (sum, index-weighted sum) of the
    old values, the same of the new). New values are ``values``, or old +
    ``d8`` with ``escapes`` where ``d8`` is ESCAPE. Work is split into
    chunks of changes (on the pool when ``NUM_THREADS`` > 1), each gathering, decoding and
    scattering while those cache lines are loaded; the caller checks the
    sums and writes the old values back if they are wrong."""
    k = idx.size
    if d8 is not None:
        esc_at = np.flatnonzero(d8 == ESCAPE)
        if escapes is None or escapes.size != esc_at.size:
            raise ValueError("diff8 escape count does not match the escape stream")
    elif values is None or values.size != k:
        raise ValueError("value stream does not match the number of positions")
    old = np.empty(k, dtype=flat.dtype)
    wide = np.int32 if flat.itemsize <= 2 else np.int64

    def one(s: int) -> tuple[int, int, int, int]:
        e = min(s + APPLY_CHUNK, k)
        at = idx[s:e]
        o = old[s:e]
        np.take(flat, at, out=o, mode="clip")  # positions were range-checked; clip avoids a buffered copy
        if d8 is None:
            n = values[s:e]
        else:
            n = (o.astype(wide) + d8[s:e]).astype(flat.dtype)
            lo, hi = np.searchsorted(esc_at, (s, e))
            if hi > lo:
                n[esc_at[lo:hi] - s] = escapes[lo:hi]
        flat[at] = n
        return (*_sums(o, at), *_sums(n, at))

    starts = range(0, k, APPLY_CHUNK)
    parts = _map(one, starts)
    mask = (1 << 64) - 1
    tot = [sum(p[i] for p in parts) & mask for i in range(4)]
    return old, (tot[0], tot[1]), (tot[2], tot[3])
