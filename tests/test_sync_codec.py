"""Delta encodings are bit-exact, whatever changes and however dense."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sync import WeightSender, apply_update
from sync.checksum import int_view, region_checksum
from sync.streams import bitmask_decode, bitmask_encode, varint_decode, varint_encode
from contracts.weights import Manifest
from tests.helpers import force_codec_path

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


def _leb128(gaps: list[int]) -> bytes:
    out = bytearray()
    for g in gaps:
        while g >= 128:
            out.append((g & 127) | 128)
            g >>= 7
        out.append(g)
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(gaps=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**40)), max_size=300),
       n_extra=st.integers(1, 100))
def test_index_codecs_write_the_wire_format(gaps: list[int], n_extra: int) -> None:
    """varint: LEB128 of the gaps minus one; bitmask: bit i % 8 of byte i // 8
    (written out here by hand, so no implementation defines the format alone)."""
    from sync.streams import varint_size

    idx = torch.cumsum(torch.tensor(gaps, dtype=torch.int64) + 1, 0) - 1
    stream = varint_encode(idx)
    assert bytes(stream.tolist()) == _leb128(gaps) and varint_size(idx) == stream.numel()
    assert torch.equal(varint_decode(stream, idx.numel()), idx)
    if gaps and idx[-1] < 10**6:
        n = int(idx[-1]) + n_extra
        want = bytearray((n + 7) // 8)
        for i in idx.tolist():
            want[i // 8] |= 1 << (i % 8)
        assert bytes(bitmask_encode(idx, n).tolist()) == bytes(want)


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 3000), frac=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_torch_streams_decode_to_what_they_encode(dtype, n: int, frac: float, seed: int) -> None:
    """The reference path (torch: any device) decodes its own streams back to
    the changed positions and values, whichever codecs it picked."""
    from sync.streams import decode_sparse, encode_sparse

    old = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    new = _perturb(old, frac, 3, seed)
    idx, old_vals, new_vals, codecs, streams = encode_sparse(old, new)
    want = torch.nonzero(int_view(old) != int_view(new)).view(-1)
    assert torch.equal(idx, want) and torch.equal(int_view(new_vals), int_view(new[idx]))
    assert torch.equal(int_view(old_vals), int_view(old[idx]))
    if codecs is None:
        return
    blob = torch.cat(streams)
    parts = tuple(s.numel() for s in streams)
    got_idx, got_vals, _ = decode_sparse(blob, parts, codecs[0], codecs[1], n, idx.numel(), lambda i: old[i], dtype)
    assert torch.equal(got_idx, idx) and torch.equal(int_view(got_vals), int_view(new[idx]))


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


@pytest.mark.parametrize("path", ["c", "torch"])
def test_delta_over_many_parts_is_bit_exact(path: str, monkeypatch) -> None:
    """A piece split into parts (run on the pool), or encoded by the torch
    reference, still encodes and applies bit for bit, from an fp32 master
    into a bf16 engine."""
    force_codec_path(monkeypatch, path, min_part=1000)
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
def test_varint_decoder_reads_leb128_or_refuses(data: list[int], count_delta: int) -> None:
    """Any byte stream: the decoder returns the positions its LEB128 gaps say
    (decoded here by hand), or raises ValueError when the stream does not hold
    ``count`` values or a value is longer than 63 bits."""
    gaps, value, shift, too_long = [], 0, 0, False
    for b in data:
        value |= (b & 0x7F) << shift
        too_long |= shift > 56
        shift += 7
        if b < 0x80:
            gaps.append(value)
            value, shift = 0, 0
    count = len(gaps) + count_delta
    buf = torch.tensor(data, dtype=torch.uint8)
    try:
        got = varint_decode(buf, count)
    except ValueError:
        assert count_delta != 0 or (data and data[-1] >= 0x80) or too_long
        return
    assert count_delta == 0 and not too_long and not (data and data[-1] >= 0x80)
    wrap = lambda x: (x + 2**63) % 2**64 - 2**63  # noqa: E731 - int64 positions wrap like the decoder's sums
    assert got.tolist() == [wrap(sum(gaps[: i + 1]) + i) for i in range(len(gaps))]


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
