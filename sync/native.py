"""Fused CPU kernels for the delta path (``sync/_native.c``), built on first use.

A numpy path made a chain of temporaries per chunk (compare, nonzero, gather,
diff, sums), each a pass over memory; on a 2-core host that made a delta of a
0.5B model cost more than a full push, several times what these kernels take
(docs/benchmarks.md, "Weight push"). They do each job in one pass:

    encode_piece  sender: compare last-sent vs current a word at a time, emit
                  varint gaps + bitmask + diff8 + escapes + sums, update last-sent
    apply_piece   receiver: decode, check, write, keep the old values and sum
                  old/new in one pass over the changed positions
    restore_piece receiver: write kept old values back (a failed update)

The C source is compiled with the system C compiler into a per-user cache the
first time it is needed (about a second) and loaded with ctypes; ctypes drops
the GIL during a call, so a piece is split into parts run on the threads of
:mod:`sync.pool`. Without a compiler, or with ``ASYNCRL_SYNC_NATIVE=0``,
:func:`available` is False and :func:`sync.codec.choose` picks the torch path,
which writes the same bytes. Only :mod:`sync.codec` (and the checksums of
:mod:`sync.checksum`) call in here.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from sync import pool

if TYPE_CHECKING:
    from sync.streams import IndexCodec

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_native.c")
_MASK64 = (1 << 64) - 1

_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


def _clib() -> ctypes.CDLL:
    """The kernels, once :func:`available` said they are."""
    assert _lib is not None, "sync.native used before available() built it"
    return _lib
_lock = threading.Lock()

_P = ctypes.c_void_p
_I = ctypes.c_int64
_ELEM: dict[int, tuple[str, type[np.unsignedinteger]]] = {2: ("u16", np.uint16), 4: ("u32", np.uint32)}
ESCAPE = -128


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((ln for ln in f if ln.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""


def _compile(out: Path, flags: list[str]) -> None:
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O3", "-std=c99", "-shared", "-fPIC", *flags, "-o", str(out), str(_SOURCE)],
                   check=True, capture_output=True, timeout=120)


def build_variant(flags: list[str], directory: str | Path) -> ctypes.CDLL:
    """Build the kernels with the given compiler flags into ``directory``
    (not cached, not used by the sync): tests check that the vector and
    portable code paths write the same bytes."""
    out = Path(directory) / f"sync_native_{hashlib.sha256(' '.join(flags).encode()).hexdigest()[:8]}.so"
    _compile(out, flags)
    return _declare(ctypes.CDLL(str(out)))


def _build() -> ctypes.CDLL:
    src = _SOURCE.read_bytes()
    # -march=native: the library is cached per source and CPU feature set
    tag = hashlib.sha256(src + os.uname().machine.encode() + _cpu_flags()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncrl"
    lib_path = cache / f"sync_native_{tag}.so"
    if not lib_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / lib_path.name
            try:
                _compile(out, ["-march=native"])
            except subprocess.CalledProcessError:  # a compiler without -march=native
                _compile(out, [])
            os.replace(out, lib_path)  # atomic: concurrent builders (Ray workers) agree
    return _declare(ctypes.CDLL(str(lib_path)))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name in ("enc_u16", "enc_u32", "enc_bf16_f32"):
        enc = getattr(lib, name)
        enc.restype = _I
        enc.argtypes = [_P, _P, _I, ctypes.c_int, _I, _P, _I, _P, _P, _P, _P, _P, _I, _P]
    for w in ("u16", "u32"):
        app = getattr(lib, f"apply_{w}")
        app.restype = _I
        app.argtypes = [_P, _I, _P, _I, ctypes.c_int, _I, _P, _P, _I, _P, ctypes.c_int, _P, _P]
    lib.bytes_sums.restype = None
    lib.bytes_sums.argtypes = [_P, _I, _P]
    lib.pack_bytes.restype = None
    lib.pack_bytes.argtypes = [_P, _P, _P, _I, _P]
    lib.bytes_sums_many.restype = None
    lib.bytes_sums_many.argtypes = [_P, _P, _I, _P]
    return lib


def available() -> bool:
    """True when the kernels are built and loaded (building them if needed)."""
    global _lib, _lib_error
    if _lib is not None:
        return True
    if _lib_error is not None or os.environ.get("ASYNCRL_SYNC_NATIVE", "1") == "0":
        return False
    with _lock:
        if _lib is None and _lib_error is None:
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as exc:
                _lib_error = str(exc)
                log.warning("sync: native delta kernels unavailable (%s); using the torch path", exc)
    return _lib is not None


def supports(itemsize: int) -> bool:
    return itemsize in _ELEM and available()


_nan_bits: int | None = -1


def _torch_nan_bits() -> int | None:
    """What torch's fp32 -> bf16 cast makes of NaN on this build and CPU
    (0x7FC0 in its scalar code, 0xFFFF in its vector code): the fused cast must
    match it bit for bit. None when it depends on the NaN's sign or payload
    (then the cast is left to torch)."""
    global _nan_bits
    if _nan_bits == -1:
        bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF] * 40, dtype=torch.int64)
        got = set()
        for n in (1, 7, bits.numel()):  # scalar tails and vector bodies alike
            f = bits[:n].to(torch.int32).view(torch.float32)
            got |= set((f.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF).tolist())
        _nan_bits = got.pop() if len(got) == 1 else None
    return _nan_bits


def fuses_cast(old: torch.Tensor, new: torch.Tensor) -> bool:
    """True when :func:`encode_piece` can cast ``new`` (fp32) to ``old``'s bf16 itself."""
    return old.dtype == torch.bfloat16 and new.dtype == torch.float32 and available() and _torch_nan_bits() is not None


def _ptr(a: np.ndarray | torch.Tensor) -> int:
    # __array_interface__ is several times cheaper than .ctypes per call
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.__array_interface__["data"][0]


def _varint(g: int) -> bytes:
    out = bytearray()
    while g >= 128:
        out.append((g & 127) | 128)
        g >>= 7
    out.append(g)
    return bytes(out)


def _varint_len_at(buf: np.ndarray, at: int) -> int:
    n = 0
    while buf[at + n] & 0x80:
        n += 1
    return n + 1


class EncodeScratch:
    """Output buffers of :func:`encode_piece`, reused across pieces and syncs
    (fresh memory per piece costs page faults comparable to the work). Sized
    for every element changing, but pages are only touched as far as changes
    are written, so what stays resident follows the changed fraction."""

    def __init__(self) -> None:
        self.n = 0
        self.itemsize = 0
        self.num_parts = 0

    def ensure(self, n: int, itemsize: int) -> None:
        num_threads = pool.NUM_THREADS
        if n <= self.n and itemsize == self.itemsize and num_threads <= self.num_parts:
            return
        n = max(n, self.n)
        self.num_parts = num_threads  # the varint buffer has a region per part
        dt = _ELEM[itemsize][1]
        self.vbuf = np.empty(n // 8 + 16 * num_threads + 16, np.uint8)
        self.bm = np.empty(n // 8 + 8, np.uint8)
        self.d8 = np.empty(n, np.int8)
        self.vals = np.empty(n, dt)
        self.olds = np.empty(n, dt)
        self.esc = np.empty(n, dt)
        self.n, self.itemsize = n, itemsize
        self.ptrs = {name: _ptr(getattr(self, name)) for name in ("vbuf", "bm", "d8", "vals", "olds", "esc")}
        self.out = np.zeros((num_threads + 1, 10), np.int64)  # one row of counters per part
        self.out_ptr = _ptr(self.out)


class NativeDelta(NamedTuple):
    """What changed in one piece, as streams ready to copy into a bucket.

    ``index``: {codec: list of uint8 chunks} for the index codecs available
    (varint is missing when its buffer overflowed: the bitmask is smaller then);
    ``d8``/``vals``/``esc``/``olds``: lists of per-part chunks (views into the
    scratch, valid until its next use); sums are piece-local (see sync.checksum)."""

    num_changed: int
    num_escapes: int
    index: dict[str, list[np.ndarray]]  # type: ignore[assignment]  # a field, not tuple.index
    index_size: dict[IndexCodec, int]
    d8: list[np.ndarray]
    vals: list[np.ndarray]
    esc: list[np.ndarray]
    olds: list[np.ndarray]
    old_sums: tuple[int, int]
    new_sums: tuple[int, int]


def encode_piece(old: torch.Tensor, new: torch.Tensor, write_old: bool, scratch: EncodeScratch) -> NativeDelta:
    """Compare two contiguous 1-D CPU pieces of one 2- or 4-byte dtype bit for
    bit (``write_old``: make ``old`` equal ``new``, changed elements only).
    ``new`` may be fp32 for a bf16 ``old`` when :func:`fuses_cast`: it is
    cast block by block in cache, exactly as torch casts."""
    assert old.is_contiguous() and new.is_contiguous() and old.numel() == new.numel()
    n, size = old.numel(), old.element_size()
    scratch.ensure(n, size)
    if new.dtype == old.dtype:
        fn, nan_bits, new_size = getattr(_lib, f"enc_{_ELEM[size][0]}"), 0, size
    else:
        assert fuses_cast(old, new), (old.dtype, new.dtype)
        fn, nan_bits, new_size = _clib().enc_bf16_f32, _torch_nan_bits() or 0, 4
    num_parts = max(1, min(pool.NUM_THREADS, n // pool.MIN_PART))
    # parts start on a bitmask byte (a multiple of 8 elements)
    step = ((n + num_parts - 1) // num_parts + 7) // 8 * 8 if num_parts > 1 else max(n, 1)
    bounds = [(s, min(s + step, n)) for s in range(0, n, step)] or [(0, 0)]
    vcap = n // 8 // len(bounds) + 16  # past this varint is no smaller than the bitmask
    o_ptr, n_ptr = old.data_ptr(), new.data_ptr()
    s = scratch

    p = s.ptrs  # s.out has a row per part: len(bounds) <= pool.NUM_THREADS

    def part(t: int):
        a, b = bounds[t]
        fn(o_ptr + a * size, n_ptr + a * new_size, b - a, int(write_old), a,
           p["vbuf"] + t * vcap, vcap, p["bm"] + a // 8, p["d8"] + a, p["vals"] + a * size,
           p["olds"] + a * size, p["esc"] + a * size, nan_bits, s.out_ptr + t * 80)
        return s.out[t]

    outs = pool.run([lambda t=t: part(t) for t in range(len(bounds))])
    k = int(sum(int(o[0]) for o in outs))
    nesc = int(sum(int(o[1]) for o in outs))
    sums = [sum(int(o[i]) for o in outs) & _MASK64 for i in range(4, 8)]
    d8, vals, esc, olds, vchunks = [], [], [], [], []
    overflow = any(int(o[3]) for o in outs)
    vsize, last = 0, -1
    for t, ((a, _), o) in enumerate(zip(bounds, outs)):
        kt, et, vlen = int(o[0]), int(o[1]), int(o[2])
        if not kt:
            continue
        d8.append(s.d8[a : a + kt])
        vals.append(s.vals[a : a + kt])
        olds.append(s.olds[a : a + kt])
        if et:
            esc.append(s.esc[a : a + et])
        if not overflow:
            v = s.vbuf[t * vcap : t * vcap + vlen]
            if a:  # the part's first gap was written relative to its own start
                head = _varint_len_at(v, 0)
                first = a + int(o[8])
                fixed = np.frombuffer(_varint(first - last - 1), np.uint8)
                vchunks.append(fixed)
                v = v[head:]
                vsize += fixed.size
            vchunks.append(v)
            vsize += v.size
        last = a + int(o[9])
    index = {"bitmask": [s.bm[: (n + 7) // 8]]}
    index_size: dict[IndexCodec, int] = {"bitmask": (n + 7) // 8}
    if not overflow:
        index["varint"], index_size["varint"] = vchunks, vsize
    return NativeDelta(k, nesc, index, index_size, d8, vals, esc, olds, (sums[0], sums[1]), (sums[2], sums[3]))


def bytes_sums(buf: np.ndarray) -> tuple[int, int]:
    """:func:`sync.checksum.bytes_checksum` of a 1-D contiguous uint8 array in one pass."""
    assert buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous
    out = np.empty(2, np.int64)
    _clib().bytes_sums(_ptr(buf), buf.size, _ptr(out))
    return int(out[0]) & _MASK64, int(out[1]) & _MASK64


def bytes_sums_many(bufs: list[torch.Tensor]) -> list[tuple[int, int]]:
    """:func:`bytes_sums` of many 1-D contiguous uint8 CPU tensors, in a few
    calls (one per thread, split by bytes): a call per small sparse payload
    cost more than summing it."""
    assert all(b.dtype == torch.uint8 and b.dim() == 1 and b.is_contiguous() and not b.is_cuda for b in bufs)
    ptrs = np.array([b.data_ptr() for b in bufs], np.int64)
    lens = np.array([b.numel() for b in bufs], np.int64)
    out = np.zeros((len(bufs), 2), np.int64)
    cuts, num_threads = [0], pool.NUM_THREADS
    if num_threads > 1 and lens.sum() >= pool.MIN_PART * num_threads:
        ends = np.cumsum(lens)
        cuts += [int(np.searchsorted(ends, ends[-1] * t // num_threads)) for t in range(1, num_threads)]
    cuts.append(len(bufs))

    def span(a: int, b: int) -> None:
        if b > a:
            _clib().bytes_sums_many(_ptr(ptrs) + 8 * a, _ptr(lens) + 8 * a, b - a, _ptr(out) + 16 * a)

    pool.run([lambda a=a, b=b: span(a, b) for a, b in zip(cuts, cuts[1:])])
    return [(int(x) & _MASK64, int(y) & _MASK64) for x, y in out.tolist()]


def pack_bytes(dst: np.ndarray, chunks: list[np.ndarray]) -> tuple[int, int]:
    """Copy 1-D contiguous uint8 ``chunks`` one after another into ``dst``
    (exactly their total size) and return :func:`bytes_sums` of ``dst``:
    a sparse piece's payload and its checksum in one call."""
    assert dst.dtype == np.uint8 and dst.flags.c_contiguous and dst.size == sum(c.size for c in chunks)
    assert all(c.dtype == np.uint8 and c.flags.c_contiguous for c in chunks)
    srcs = np.array([_ptr(c) for c in chunks], np.int64)
    lens = np.array([c.size for c in chunks], np.int64)
    out = np.empty(2, np.int64)
    _clib().pack_bytes(_ptr(dst), _ptr(srcs), _ptr(lens), len(chunks), _ptr(out))
    return int(out[0]) & _MASK64, int(out[1]) & _MASK64


_CODEC = {"varint": 0, "bitmask": 1}
_ERRORS = {-1: "index stream ends early or has extra bytes", -2: "position out of range",
           -3: "number of positions does not match the manifest", -4: "diff8 escape count does not match",
           -5: "varint value too long"}


def _aligned(a: np.ndarray, dtype: type[np.unsignedinteger]) -> np.ndarray:
    """``a`` (uint8) viewed as ``dtype``, copied when misaligned for it."""
    if _ptr(a) % np.dtype(dtype).itemsize or a.size % np.dtype(dtype).itemsize:
        a = a.copy()
    return a.view(dtype)


def _streams(blob: np.ndarray, parts: tuple[int, ...], index_codec: str, value_codec: str, num_changed: int,
             dtype: type[np.unsignedinteger]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    if len(parts) != 3 or sum(parts) != blob.size:
        raise ValueError(f"sparse parts {parts} do not add up to {blob.size} bytes")
    if index_codec not in _CODEC:
        raise ValueError(f"unknown index codec {index_codec!r}")
    a, b = parts[0], parts[0] + parts[1]
    size = np.dtype(dtype).itemsize
    if value_codec == "diff8":
        if parts[1] != num_changed or parts[2] % size:
            raise ValueError("diff8 value stream does not match the number of positions")
        d8, vals = blob[a:b].view(np.int8), _aligned(blob[b:], dtype)
    elif value_codec == "raw":
        if parts[1] != num_changed * size or parts[2]:
            raise ValueError("value stream does not match the number of positions")
        d8, vals = None, _aligned(blob[a:b], dtype)
    else:
        raise ValueError(f"unknown value codec {value_codec!r}")
    return blob[:a], d8, vals


def _apply(flat: np.ndarray, idx_s: np.ndarray, codec: str, num_changed: int, d8: np.ndarray | None,
           vals: np.ndarray | None, olds: np.ndarray, mode: int) -> tuple[int, np.ndarray, int]:
    fn = getattr(_lib, f"apply_{_ELEM[flat.itemsize][0]}")
    sums, written = np.zeros(4, np.int64), np.zeros(1, np.int64)
    rc = fn(_ptr(flat), flat.size, _ptr(idx_s), idx_s.size, _CODEC[codec], num_changed,
            0 if d8 is None else _ptr(d8), 0 if vals is None else _ptr(vals), 0 if vals is None else vals.size,
            _ptr(olds), mode, _ptr(sums), _ptr(written))
    return int(rc), sums, int(written[0])


def apply_piece(flat: np.ndarray, blob: np.ndarray, parts: tuple[int, ...], index_codec: str, value_codec: str,
                count: int, num_changed: int) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """Decode a sparse blob and write it into ``flat`` (writable integer view
    of one contiguous CPU piece of ``count`` elements) in one pass. Returns
    (old values at the changed positions, piece-local sums of the old values,
    of the new). A malformed blob raises ValueError with ``flat`` as it was."""
    assert flat.size == count and flat.itemsize in _ELEM
    idx_s, d8, vals = _streams(blob, parts, index_codec, value_codec, num_changed, _ELEM[flat.itemsize][1])
    olds = np.empty(num_changed, flat.dtype)
    rc, sums, written = _apply(flat, idx_s, index_codec, num_changed, d8, vals, olds, 1 if d8 is None else 0)
    if rc:
        if written:  # put back what was written before the stream went bad
            _apply(flat, idx_s, index_codec, written, None, None, olds[:written], 2)
        raise ValueError(f"undecodable sparse payload: {_ERRORS.get(rc, rc)}")
    tot = [int(x) & _MASK64 for x in sums]
    return olds, (tot[0], tot[1]), (tot[2], tot[3])


def restore_piece(flat: np.ndarray, blob: np.ndarray, parts: tuple[int, ...], index_codec: str, count: int,
                  olds: np.ndarray) -> None:
    """Write ``olds`` back at the positions of an applied blob (rollback)."""
    rc, _, written = _apply(flat, blob[: parts[0]], index_codec, olds.size, None, None, olds, 2)
    assert written == olds.size, (rc, written)

