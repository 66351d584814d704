"""NumPy versions of the :mod:`sync.codec` streams, used for CPU tensors.

Same bytes as the torch versions (tested against each other); numpy's
integer ufuncs and fancy indexing are several times faster than torch's on
CPU for the int64 gap arithmetic these need.
"""

from __future__ import annotations

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
