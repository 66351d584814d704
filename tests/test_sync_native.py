"""The fused C kernels write the same bytes as the torch reference
(sync.streams), cast exactly as torch does, refuse malformed streams without
writing, and undo exactly."""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sync import WeightSender, apply_update, native, pool
from sync.checksum import int_view
from sync.streams import ESCAPE, bitmask_encode, decode_index, diff8_encode, varint_encode
from contracts.weights import ShardSpec

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not native.available(), reason="no C compiler: the torch path is used")]


@contextlib.contextmanager
def _parts(num_threads: int, min_part: int = 8):
    """Split even tiny pieces into ``num_threads`` parts (on the pool)."""
    saved = pool.NUM_THREADS, pool.MIN_PART
    pool.NUM_THREADS, pool.MIN_PART = num_threads, min_part
    try:
        yield
    finally:
        pool.NUM_THREADS, pool.MIN_PART = saved


def _pair(dtype: torch.dtype, n: int, frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g).to(dtype)
    new = old.clone()
    bits = int_view(new)
    mask = torch.rand(n, generator=g) < frac
    bits[mask] += torch.randint(-300, 300, (int(mask.sum()),), generator=g).to(bits.dtype)
    return old, new


def _cat(chunks: list[np.ndarray], dtype=np.uint8) -> np.ndarray:
    return np.concatenate(chunks) if chunks else np.empty(0, dtype)


class _Want(NamedTuple):
    """What the torch reference makes of a piece: positions, old and new values
    there (integer views), their (sum, index-weighted sum), diff8 stream and escapes."""

    idx: np.ndarray
    old: np.ndarray
    new: np.ndarray
    old_sums: tuple[int, int]
    new_sums: tuple[int, int]
    d8: np.ndarray
    escapes: np.ndarray
    bitmask: np.ndarray
    varint: np.ndarray


def _reference(old: torch.Tensor, new: torch.Tensor) -> _Want:
    o, v = int_view(old), int_view(new)
    idx = torch.nonzero(o != v).view(-1)
    ov, nv = o[idx], v[idx]
    d8, escapes = diff8_encode(ov, nv)

    def sums(x: torch.Tensor) -> tuple[int, int]:
        x = x.to(torch.int64)
        return int(x.sum()) & (2**64 - 1), int((x * idx).sum()) & (2**64 - 1)

    return _Want(idx.numpy(), ov.numpy(), nv.numpy(), sums(ov), sums(nv), d8.numpy(), escapes.numpy(),
                 bitmask_encode(idx, o.numel()).numpy(), varint_encode(idx).numpy())


def _check_against_torch(dtype: torch.dtype, n: int, frac: float, seed: int) -> None:
    old, new = _pair(dtype, n, frac, seed)
    want = _reference(old, new)
    mine = old.clone()
    d = native.encode_piece(mine, new, True, native.EncodeScratch())
    assert torch.equal(int_view(mine), int_view(new)), "last-sent copy not updated"
    _assert_same_streams(d, want, n)
    for codec in d.index:
        for value_codec in ("diff8", "raw"):
            _check_apply(old, new, d, codec, value_codec)


def _assert_same_streams(d: native.NativeDelta, want: _Want, n: int) -> None:
    """The kernel's counts, sums and streams are the torch reference's."""
    assert d.num_changed == want.idx.size and d.num_escapes == want.escapes.size
    assert (d.old_sums, d.new_sums) == (want.old_sums, want.new_sums)
    assert np.array_equal(_cat(d.d8, np.int8), want.d8)
    assert np.array_equal(_cat(d.olds).view(want.old.dtype), want.old)
    assert np.array_equal(_cat(d.vals).view(want.new.dtype), want.new)
    assert np.array_equal(_cat(d.esc).view(want.new.dtype), want.escapes)
    assert np.array_equal(_cat(d.index["bitmask"]), want.bitmask)
    if "varint" in d.index:
        assert np.array_equal(_cat(d.index["varint"]), want.varint)


def _check_apply(old: torch.Tensor, new: torch.Tensor, d: native.NativeDelta, codec: str, value_codec: str) -> None:
    index = _cat(d.index[codec])
    if value_codec == "diff8":
        values, escapes = _cat(d.d8, np.int8).view(np.uint8), _cat(d.esc).view(np.uint8)
    else:
        values, escapes = _cat(d.vals).view(np.uint8), np.empty(0, np.uint8)
    blob, parts = np.concatenate([index, values, escapes]), (index.size, values.size, escapes.size)
    flat = int_view(old.clone()).numpy()
    before = flat.copy()
    olds, old_sums, new_sums = native.apply_piece(flat, blob, parts, codec, value_codec, flat.size, d.num_changed)
    assert np.array_equal(flat, int_view(new).numpy()), f"{codec}+{value_codec} not bit-exact"
    assert (old_sums, new_sums) == (d.old_sums, d.new_sums)
    native.restore_piece(flat, blob, parts, codec, flat.size, olds)
    assert np.array_equal(flat, before), "rollback did not restore the piece"


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       n=st.one_of(st.integers(1, 3000), st.sampled_from([8192, 8195, 16387, 70_001])),
       frac=st.sampled_from([0.0, 0.001, 0.04, 0.3, 1.0]), threads=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**31))
def test_kernels_write_the_torch_paths_bytes(dtype, n, frac, threads, seed) -> None:
    with _parts(threads):
        _check_against_torch(dtype, n, frac, seed)


def test_fused_cast_is_torchs_cast_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (2_000_000,), generator=g, dtype=torch.int64)
    edges = [0, 1, -1, 0x7F7FFFFF, 0x7F800000, -0x800000, 0x7F7F8000, 0x3F808000, 0x3F818000, 0x3F807FFF,
             0x00008000, 0x00018000, 0x7FC00000, 0x7F800001, -0x400000, 0x7FFFFFFF]
    x = torch.cat([bits, torch.tensor(edges, dtype=torch.int64)]).to(torch.int32).view(torch.float32)
    if not native.fuses_cast(torch.empty(0, dtype=torch.bfloat16), x):
        pytest.skip("torch's NaN cast depends on the payload here: the cast is left to torch")
    for threads in (1, 2):
        with _parts(threads):
            got = torch.zeros(x.numel(), dtype=torch.bfloat16)
            native.encode_piece(got, x, True, native.EncodeScratch())
            assert torch.equal(int_view(got), int_view(x.to(torch.bfloat16)))


def test_portable_and_vector_builds_agree(tmp_path) -> None:
    """The compare has AVX-512, AVX2 and plain-C versions: all write the same."""
    saved = native._lib
    try:
        for flags in (["-mno-avx2", "-mno-avx512f"], ["-mavx2", "-mno-avx512f"]):
            try:
                native._lib = native.build_variant(flags, tmp_path)
            except Exception as exc:  # a compiler or CPU without these targets
                pytest.skip(f"cannot build with {flags}: {exc}")
            for dtype in (torch.bfloat16, torch.float32):
                for n, frac in ((1000, 0.05), (70_001, 0.3), (8192, 1.0)):
                    with _parts(2):
                        _check_against_torch(dtype, n, frac, seed=n)
    finally:
        native._lib = saved


@pytest.mark.parametrize("codec", ["varint", "bitmask"])
def test_malformed_streams_are_refused_before_anything_is_written(codec: str) -> None:
    old, new = _pair(torch.bfloat16, 5000, 0.05, 3)
    d = native.encode_piece(old.clone(), new, True, native.EncodeScratch())
    index, d8 = _cat(d.index[codec]), _cat(d.d8, np.int8)
    esc = _cat(d.esc).view(np.uint8)
    flat = int_view(old.clone()).numpy()
    before = flat.copy()

    def attempt(index: np.ndarray, d8: np.ndarray, esc: np.ndarray, k: int, count: int = flat.size) -> None:
        blob = np.concatenate([index, d8.view(np.uint8), esc])
        with pytest.raises(ValueError):
            native.apply_piece(flat[:count], blob, (index.size, d8.size, esc.size), codec, "diff8", count, k)
        assert np.array_equal(flat, before)

    k = d.num_changed
    attempt(index, d8[:-1], esc, k - 1)  # one position more than values
    attempt(index[:-1], d8, esc, k)  # stream cut short
    last = int(decode_index(torch.from_numpy(index), codec, flat.size, k)[-1])
    attempt(index, d8, esc, k, count=last)  # the last position past the piece's end
    bad = d8.copy()
    bad[np.flatnonzero(bad != ESCAPE)[0]] = ESCAPE  # an escape without its value
    attempt(index, bad, esc, k)
    if codec == "varint":
        attempt(np.concatenate([index, np.full(10, 0x80, np.uint8), [0]]).astype(np.uint8), d8, esc, k + 1)


def _master(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 70, generator=g) * 0.02, "v": torch.randn(40_003, generator=g) * 0.02}


def _adam_like_step(master: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in master.values():
        t -= lr * torch.sign(torch.randn(t.shape, generator=g))


@pytest.mark.parametrize("use_native", [True, False])
def test_delta_round_trip_and_revert_with_and_without_kernels(use_native: bool, monkeypatch) -> None:
    """fp32 master -> bf16 engine through WeightSender/apply_update, on the
    kernels and on the torch path: bit-exact, and revert_update takes the
    engine back to the previous version exactly."""
    if not use_native:
        monkeypatch.setattr(native, "_lib", None)
        monkeypatch.setattr(native, "_lib_error", "disabled for this test")
    master = _master(0)
    sender = WeightSender(mode="delta", dtype=torch.bfloat16, bucket_bytes=64 << 10)
    engine = {k: torch.zeros_like(t, dtype=torch.bfloat16) for k, t in master.items()}
    version = apply_update(engine, sender.encode(master, 1), 0, verify="full")
    for step, lr in enumerate((1e-6, 1e-4, 1e-3)):
        before = {k: t.clone() for k, t in engine.items()}
        _adam_like_step(master, lr, step)
        update = sender.encode(master, version + 1)
        assert update.manifest.kind == "delta"
        version = apply_update(engine, update, version, verify="full")
        for k, t in master.items():
            assert torch.equal(int_view(engine[k]), int_view(t.bfloat16()))
        undo = sender.revert_update()
        version = apply_update(engine, undo, version, verify="full")
        assert version == step + 1 and all(torch.equal(int_view(engine[k]), int_view(before[k])) for k in engine)
        version = apply_update(engine, sender.encode(master, version + 1), version, verify="full")


def test_fp32_engine_delta_is_bit_exact() -> None:
    """The default CPU job syncs fp32: the 4-byte kernels carry it."""
    master = _master(1)
    sender = WeightSender(mode="delta", dtype=torch.float32, bucket_bytes=64 << 10)
    engine = {k: torch.zeros_like(t) for k, t in master.items()}
    version = apply_update(engine, sender.encode(master, 1), 0, verify="full")
    _adam_like_step(master, 1e-5, 7)
    update = sender.encode(master, 2)
    assert update.manifest.kind == "delta"
    apply_update(engine, update, version, verify="full")
    assert all(torch.equal(engine[k], master[k]) for k in master)


def test_non_contiguous_shard_on_the_kernels() -> None:
    """A column shard is not a contiguous range of the full tensor: its
    checksums need positions, decoded from the kernel's index stream."""
    full = torch.randn(6, 10) * 0.02
    spec = ShardSpec(full_shape=(6, 10), dim=1, offset=4, length=5)
    sender = WeightSender(mode="delta", dtype=torch.bfloat16, bucket_bytes=64)
    engine = {"w": torch.zeros(6, 10, dtype=torch.bfloat16)}
    engine["w"][:, :4] = full[:, :4].bfloat16()
    engine["w"][:, 9:] = full[:, 9:].bfloat16()
    shard = full[:, 4:9].contiguous()
    version = apply_update(engine, sender.encode([("w", shard, spec)], 1), 0, verify="full")
    shard[::2] += 0.01
    update = sender.encode([("w", shard, spec)], 2)
    assert update.manifest.kind == "delta"
    apply_update(engine, update, version, verify="full")
    assert torch.equal(engine["w"][:, 4:9], shard.bfloat16())


@pytest.mark.parametrize("sizes", [None, [10] * 6, [pool.MIN_PART] * 6, [1, pool.MIN_PART, 1, 1, pool.MIN_PART, 5]])
def test_run_each_keeps_order_and_isolates_failures(sizes, monkeypatch) -> None:
    """Small thunks share a task (or run on this thread), large ones get their
    own; either way every result comes back in order, a raise as its exception."""
    monkeypatch.setattr(pool, "NUM_THREADS", 2)
    threads: list[str] = []

    def job(i: int):
        def run() -> int:
            threads.append(threading.current_thread().name)
            if i == 3:
                raise ValueError("piece 3")
            return i * i
        return run

    out = pool.run_each([job(i) for i in range(6)], sizes)
    assert [r for i, r in enumerate(out) if i != 3] == [0, 1, 4, 16, 25]
    assert isinstance(out[3], ValueError) and str(out[3]) == "piece 3"
    on_pool = {name for name in threads if name.startswith("sync-native")}
    assert bool(on_pool) == (sizes != [10] * 6)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 4096 * 8 + 3, 100_003])
def test_payload_checksum_kernel_is_the_numpy_checksum(n: int) -> None:
    """bytes_sums, bytes_sums_many and pack_bytes (copy + sum) give sync.checksum's numpy answer."""
    from sync import checksum as cks

    buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = (0, 0)
    for region, first in cks._bytes_regions(torch.from_numpy(buf)):
        want = cks.add(want, cks.region_checksum(region, first))
    assert native.bytes_sums(buf) == want
    assert cks.bytes_checksum(torch.from_numpy(buf)) == want
    assert cks.bytes_checksums([torch.from_numpy(buf), torch.from_numpy(buf[: n // 2])]) == [
        want, cks.bytes_checksum(torch.from_numpy(buf[: n // 2]))]
    dst = np.full(n, 0xAB, np.uint8)
    assert native.pack_bytes(dst, [buf[: n // 3], buf[n // 3 : n // 2], buf[n // 2 :]]) == want
    assert np.array_equal(dst, buf)


@pytest.mark.parametrize("frac", [0.0005, 0.04, 0.2, 1.0])
@pytest.mark.parametrize("fp32_new", [False, True])
def test_encode_matches_torch_for_optimizer_like_steps(frac: float, fp32_new: bool) -> None:
    """Changes of a unit or two in the last place (an optimizer step) with a
    few large jumps, every density the codecs switch at, the new values in
    bf16 or in fp32 cast by the kernel: the same streams and sums as torch."""
    n = 3 * 8192 + 77
    g = torch.Generator().manual_seed(int(frac * 1e4) + fp32_new)
    new32 = torch.randn(n, generator=g)
    old = new32.to(torch.bfloat16)
    bits = int_view(old)
    mask = torch.rand(n, generator=g) < frac
    step = torch.randint(-2, 3, (n,), generator=g)
    step[torch.rand(n, generator=g) < 0.05] = 1000  # escapes
    bits[mask] -= step[mask].to(bits.dtype)
    new = new32.to(torch.bfloat16)
    want = _reference(old, new)
    for threads in (1, 2):
        with _parts(threads):
            mine = old.clone()
            d = native.encode_piece(mine, new32 if fp32_new and native.fuses_cast(mine, new32) else new, True,
                                    native.EncodeScratch())
        assert torch.equal(int_view(mine), int_view(new))
        _assert_same_streams(d, want, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_and_the_torch_path_send_the_same_updates(dtype: torch.dtype, monkeypatch) -> None:
    """``sync.codec.choose`` only changes who writes the bytes: every update of
    a run (deltas at several densities, a column shard, the undo of the last)
    is the same manifest over the same payload either way."""
    import msgspec

    def run() -> list:
        master = _master(2)
        spec = ShardSpec(full_shape=(300, 70), dim=1, offset=10, length=30)
        sender = WeightSender(mode="delta", dtype=dtype, bucket_bytes=64 << 10)

        def named():
            return [("w", master["w"][:, 10:40].contiguous(), spec), ("v", master["v"], None)]

        updates = [sender.encode(named(), 1)]
        g = torch.Generator().manual_seed(3)
        for step, frac in enumerate((0.001, 0.05, 0.3, 1.0)):  # the share of elements a step moves
            for t in master.values():
                moved = torch.rand(t.shape, generator=g) < frac
                t[moved] -= 1e-3 * torch.sign(torch.randn(t.shape, generator=g))[moved]
            updates.append(sender.encode(named(), step + 2))
        updates.append(sender.revert_update())
        return [(msgspec.structs.replace(u.manifest, encode_ms=0.0), [bytes(b.numpy()) for b in u.buckets])
                for u in updates]

    with_kernels = run()
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_lib_error", "disabled for this test")
    assert run() == with_kernels
