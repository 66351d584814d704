"""Delta encodings are bit-exact, whatever changes and however dense."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sync import WeightSender, apply_update
from sync.checksum import int_view, region_checksum
from sync.codec import bitmask_decode, bitmask_encode, varint_decode, varint_encode
from sync.manifest import Manifest, WeightUpdate

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
    engine = {"a": torch.zeros(10, 10, dtype=torch.bfloat16)}
    apply_update(engine, sender_full := WeightSender(mode="full").encode({"a": w["a"].clone()}, 2), 0)
    assert sender_full.manifest.kind == "full"
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
