"""Delta encodings are bit-exact, whatever changes and however dense."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sync import WeightSender, apply_update
from sync.checksum import int_view, region_checksum
from sync.codec import bitmask_decode, bitmask_encode, varint_decode, varint_encode
from contracts.weights import Manifest

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.bfloat16]


def _sorted_positions(draw_seed: int, n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw_seed)
    return torch.randperm(n, generator=g)[:k].sort().values


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), frac=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_index_codecs_round_trip_any_positions(n: int, frac: float, seed: int) -> None:
    idx = _sorted_positions(seed, n, int(n * frac))
    assert torch.equal(varint_decode(varint_encode(idx), idx.numel()), idx)
    assert torch.equal(bitmask_decode(bitmask_encode(idx, n), n), idx)


def test_varint_handles_long_gaps() -> None:
    idx = torch.tensor([0, 1, 200, 70_000, 2**33, 2**33 + 1])
    assert torch.equal(varint_decode(varint_encode(idx), 6), idx)


def _perturb(t: torch.Tensor, frac: float, ulps: int, seed: int) -> torch.Tensor:
    """Change about ``frac`` of the elements: most by a few units in the last
    place, a tenth to unrelated values (sign flips, zeros, huge jumps)."""
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    flat, bits = out.view(-1), int_view(out)
    mask = torch.rand(flat.numel(), generator=g) < frac
    steps = torch.randint(-ulps, ulps + 1, (flat.numel(),), generator=g).to(bits.dtype)
    bits[mask] += steps[mask]
    wild = mask & (torch.rand(flat.numel(), generator=g) < 0.1)
    flat[wild] = torch.randn(int(wild.sum()), generator=g).to(t.dtype) * 100
    return out


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    steps=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 300)), min_size=1, max_size=4),
    bucket_bytes=st.sampled_from([64, 1000, 1 << 20]),
    seed=st.integers(0, 2**31),
)
def test_delta_apply_is_bit_exact(dtype, shape, steps, bucket_bytes, seed) -> None:
    trainer = {"w": torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype), "b": torch.ones(3)}
    sender = WeightSender(mode="delta", bucket_bytes=bucket_bytes, dtype=dtype)
    engine = {k: torch.zeros_like(v, dtype=dtype) for k, v in trainer.items()}
    version = apply_update(engine, sender.encode(trainer, 1), 0, verify="full")
    for i, (frac, ulps) in enumerate(steps):
        trainer["w"] = _perturb(trainer["w"], frac, ulps, seed + i)
        update = sender.encode(trainer, version + 1)
        assert update.manifest.kind == "delta"
        assert all(len(b) <= bucket_bytes for b in update.buckets)
        version = apply_update(engine, update, version, verify="full")
        assert torch.equal(int_view(engine["w"]), int_view(trainer["w"])), "not bit-identical"
        assert torch.equal(engine["b"], trainer["b"].to(dtype))


def test_bf16_delta_costs_at_most_3_bytes_per_changed_element() -> None:
    torch.manual_seed(0)
    master = torch.randn(1 << 20) * 0.02
    sender = WeightSender(mode="delta", dtype=torch.bfloat16)
    sender.encode({"w": master}, 1)
    for lr, version in ((1e-6, 2), (1e-5, 3)):
        master -= lr * torch.sign(torch.randn_like(master))  # an Adam-sized step
        update = sender.encode({"w": master}, version)
        changed = update.manifest.num_changed
        assert 0 < changed < master.numel()
        assert update.nbytes / changed <= 3.0, (lr, update.nbytes / changed)


def test_manifest_round_trips_through_msgpack() -> None:
    sender = WeightSender(mode="delta", bucket_bytes=256)
    w = {"a": torch.randn(10, 10)}
    sender.encode(w, 1)
    w["a"][3, 4] += 1
    update = sender.encode(w, 2)
    wire = msgspec.msgpack.encode(update.manifest)
    manifest = msgspec.msgpack.decode(wire, type=Manifest)
    assert manifest == update.manifest
    full = WeightSender(mode="full").encode({"a": w["a"].clone()}, 2)
    assert full.manifest.kind == "full"
    engine = {"a": torch.zeros(10, 10, dtype=torch.bfloat16)}
    apply_update(engine, full, 0)
    assert torch.equal(engine["a"], w["a"].bfloat16())


def test_checksum_is_additive_over_pieces() -> None:
    x = torch.randn(10_000).bfloat16()
    whole = region_checksum(x, 0)
    a, b = region_checksum(x[:4097], 0), region_checksum(x[4097:], 4097)
    assert whole == ((a[0] + b[0]) % 2**64, (a[1] + b[1]) % 2**64)
    y = x.clone()
    y[[5, 9]] = y[[9, 5]]
    if not torch.equal(int_view(x[5:6]), int_view(x[9:10])):
        assert region_checksum(y, 0) != whole


@settings(max_examples=60, deadline=None)
@given(gaps=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**40)), max_size=300),
       n_extra=st.integers(1, 100))
def test_numpy_and_torch_index_codecs_write_the_same_bytes(gaps: list[int], n_extra: int) -> None:
    import numpy as np

    from sync import codec_np as cnp
    from sync.codec import varint_size

    idx = torch.cumsum(torch.tensor(gaps, dtype=torch.int64) + 1, 0) - 1
    plan = cnp.VarintPlan(cnp.gaps_of(idx.numpy()))
    stream = cnp.varint_encode(cnp.gaps_of(idx.numpy()), plan)
    assert np.array_equal(stream, varint_encode(idx).numpy()) and plan.size == varint_size(idx) == stream.size
    assert np.array_equal(cnp.varint_decode(stream, idx.numel()), idx.numpy())
    if gaps and idx[-1] < 10**6:
        n = int(idx[-1]) + n_extra
        assert np.array_equal(cnp.bitmask_encode(idx.numpy(), n), bitmask_encode(idx, n).numpy())


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 3000), frac=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_torch_path_matches_numpy_path(dtype, n: int, frac: float, seed: int) -> None:
    """The CUDA code path (torch ops) run on CPU writes what the CPU path writes."""
    from sync.codec import _decode_sparse_np, _decode_sparse_torch, _encode_sparse_np, _encode_sparse_torch

    old = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    new = _perturb(old, frac, 3, seed)
    a_idx, a_old, a_vals, a_plan, a_sums = _encode_sparse_np(old, new)
    b_idx, b_old, b_vals, b_plan, _ = _encode_sparse_torch(old, new)
    if a_idx.numel():
        from sync.checksum import shift_sums, sparse_checksum

        assert shift_sums(a_sums[0], None, 0) == sparse_checksum(a_old, a_idx, None, 0)
        assert shift_sums(a_sums[1], None, 0) == sparse_checksum(a_vals, a_idx, None, 0)
    assert torch.equal(a_idx, b_idx) and torch.equal(int_view(a_vals), int_view(b_vals))
    assert torch.equal(int_view(a_old), int_view(b_old)) and torch.equal(int_view(a_old), int_view(old[a_idx]))
    assert (a_plan is None) == (b_plan is None)
    if a_plan is None:
        return
    assert a_plan[:2] == b_plan[:2]
    assert all(torch.equal(x, y) for x, y in zip(a_plan[2], b_plan[2]))
    blob = torch.cat(a_plan[2])
    a, b = a_plan[2][0].numel(), a_plan[2][0].numel() + a_plan[2][1].numel()
    args = (a, b, a_plan[0], a_plan[1], n, a_idx.numel(), lambda i: old[i], dtype)
    got_np = _decode_sparse_np(blob.numpy(), *args)
    got_torch = _decode_sparse_torch(blob, *args)
    for idx, vals, _ in (got_np, got_torch):
        assert torch.equal(idx, a_idx) and torch.equal(int_view(vals), int_view(new[a_idx]))


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 70_001])
def test_torch_and_numpy_checksums_agree(n: int) -> None:
    """The CUDA path's integer sums (run here on CPU) equal the numpy path's."""
    from sync.checksum import _dot_torch, _weighted_np, _weighted_torch

    for dtype in (torch.int16, torch.int32):
        x = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int64).to(dtype)
        if dtype == torch.int32:
            x = x * 65_537  # large values: products wrap past 2**63
        s0, sj = _weighted_torch(x).tolist()
        assert (s0 % 2**64, sj % 2**64) == tuple(v % 2**64 for v in _weighted_np(x.numpy()))
        idx = torch.arange(n)
        assert _dot_torch(x, idx) == (s0, sj)


@settings(max_examples=60, deadline=None)
@given(itemsize=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 3000), frac=st.floats(0, 1),
       offset=st.integers(0, 7), chunk=st.sampled_from([1, 5, 64, 1 << 18]), seed=st.integers(0, 2**31))
def test_word_compare_finds_exactly_the_changed_elements(itemsize, n, frac, offset, chunk, seed) -> None:
    """The word-at-a-time compare (any alignment, chunking and element size)
    returns what a plain element compare returns, and with ``write_old``
    leaves the old array equal to the new one."""


    with _compare_chunk(chunk):
        _check_word_compare(itemsize, n, frac, offset, seed)


def _check_word_compare(itemsize: int, n: int, frac: float, offset: int, seed: int) -> None:
    import numpy as np

    from sync import codec_np as cnp

    rng = np.random.default_rng(seed)
    dtype = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize]
    base = rng.integers(-100, 100, n + offset).astype(dtype)
    new_base = base.copy()
    flip = rng.random(n + offset) < frac
    new_base[flip] += 1
    old, new = base[offset:], new_base[offset:]  # misaligned views on purpose
    want = np.flatnonzero(old != new)
    found = cnp.find_changes(old, new)
    idx, o, v = found.idx, found.old, found.new
    assert np.array_equal(idx, want) and np.array_equal(o, old[want]) and np.array_equal(v, new[want])
    mask = 2**64 - 1
    w64 = want.astype(np.int64)
    for vals, sums in ((o, found.old_sums), (v, found.new_sums)):
        x = vals.astype(np.int64)
        assert sums == (int(x.sum()) & mask, int(np.dot(x, w64)) & mask)
    if itemsize > 1:
        d8, fits = cnp.diff8(o, v)
        assert np.array_equal(found.d8, d8) and found.num_escapes == int((~fits).sum())
    idx2, o2, v2 = cnp.find_changes(old, new, write_old=True)[:3]
    assert np.array_equal(idx2, want) and np.array_equal(o2, o) and np.array_equal(v2, v)
    assert np.array_equal(old, new)


@contextlib.contextmanager
def _compare_chunk(n: int):
    """Compare tasks of ``n`` elements on a 2-thread pool, so small tensors exercise it."""
    from sync import codec_np as cnp

    saved, cnp.COMPARE_CHUNK = cnp.COMPARE_CHUNK, n
    saved_threads, cnp.NUM_THREADS = cnp.NUM_THREADS, 2  # and through the pool
    try:
        yield
    finally:
        cnp.COMPARE_CHUNK, cnp.NUM_THREADS = saved, saved_threads


def test_delta_over_many_compare_chunks_is_bit_exact() -> None:
    """A piece split across compare tasks (run on the pool) still encodes
    and applies bit for bit, from an fp32 master into a bf16 engine."""
    with _compare_chunk(1000):
        _check_many_chunks()


def _check_many_chunks() -> None:
    torch.manual_seed(1)
    master = {"w": torch.randn(40_003) * 0.02, "v": torch.randn(7, 13)}
    sender = WeightSender(mode="delta", dtype=torch.bfloat16, bucket_bytes=32 << 10)
    engine = {k: torch.zeros_like(t, dtype=torch.bfloat16) for k, t in master.items()}
    version = apply_update(engine, sender.encode(master, 1), 0, verify="full")
    for step in range(3):
        for t in master.values():
            t -= 1e-5 * torch.sign(torch.randn_like(t))
        update = sender.encode(master, version + 1)
        assert update.manifest.kind == "delta"
        version = apply_update(engine, update, version, verify="full")
        for k, t in master.items():
            assert torch.equal(int_view(engine[k]), int_view(t.bfloat16()))


@settings(max_examples=100, deadline=None)
@given(data=st.lists(st.one_of(st.integers(0, 127), st.integers(128, 255)), max_size=200),
       count_delta=st.integers(-2, 2))
def test_numpy_varint_decoder_agrees_with_torch_or_refuses(data: list[int], count_delta: int) -> None:
    """Any byte stream (runs of continuation bytes capped so values fit in
    63 bits): the numpy decoder returns what the torch decoder returns, or
    raises ValueError when the stream does not hold ``count`` values."""
    import numpy as np

    from sync import codec_np as cnp

    buf = np.array(data, dtype=np.uint8)
    run = 0
    for i, b in enumerate(buf):  # at most 8 continuation bytes in a row
        run = run + 1 if b >= 0x80 else 0
        if run > 8:
            buf[i] &= 0x7F
            run = 0
    count = int((buf < 0x80).sum()) + count_delta
    try:
        got = cnp.varint_decode(buf, count)
    except ValueError:
        assert count_delta != 0 or (buf.size and buf[-1] >= 0x80)
        return
    assert torch.equal(torch.from_numpy(got), varint_decode(torch.from_numpy(buf.copy()), count))


@pytest.mark.parametrize("shard", [None, "contiguous", "strided"])
def test_device_sums_read_back_together_equal_the_host_checksums(shard) -> None:
    """The GPU path's deferred sums (torch ops, run here on CPU tensors) give
    the numpy path's checksums for pieces, byte payloads and sharded pieces."""
    from sync.checksum import bytes_checksum, bytes_sums, piece_checksum, piece_sums, read_sums
    from contracts.weights import ShardSpec

    spec = {None: None, "contiguous": ShardSpec(full_shape=(40, 8), dim=0, offset=10, length=20),
            "strided": ShardSpec(full_shape=(40, 8), dim=1, offset=2, length=4)}[shard]
    g = torch.Generator().manual_seed(1)
    values = torch.randn(64, generator=g).bfloat16()
    payload = torch.randint(0, 256, (77,), dtype=torch.uint8, generator=g)
    pieces = [(values, 0), (values[:50], 13)] if spec is None or spec.is_contiguous else [(values[:60], 20)]
    want = [piece_checksum(v, spec, start) for v, start in pieces] + [bytes_checksum(payload)]
    got = read_sums([piece_sums(v, spec, start) for v, start in pieces] + [bytes_sums(payload)])
    assert got == want


@pytest.mark.parametrize("group_elems", [1 << 22, 100])
def test_pieces_summed_together_equal_each_alone(group_elems, monkeypatch) -> None:
    """The segmented pass over many small pieces (one group, or several when
    the group size is small) gives every piece's own checksum: mixed dtypes,
    strided and contiguous shards, empty and large pieces, positions past 2**32."""
    from sync import checksum as cks
    from contracts.weights import ShardSpec

    monkeypatch.setattr(cks, "_GROUP_ELEMS", group_elems)
    g = torch.Generator().manual_seed(2)
    contiguous = ShardSpec(full_shape=(40, 8), dim=0, offset=10, length=20)
    strided = ShardSpec(full_shape=(40, 8), dim=1, offset=2, length=4)
    items = []
    for i in range(30):
        dtype = (torch.bfloat16, torch.float32, torch.float16)[i % 3]
        n = int(torch.randint(0, 300, (1,), generator=g))
        items.append((torch.randn(n, generator=g).to(dtype), None, int(torch.randint(0, 1 << 40, (1,), generator=g))))
    items += [(torch.randn(160).bfloat16(), contiguous, 0), (torch.randn(60).bfloat16(), strided, 20),
              (torch.randn(150).float()[::2], None, 7)]
    got = cks.read_sums(cks.pieces_sums(items))
    assert got == [cks.piece_checksum(v, spec, start) for v, spec, start in items]
