"""apply_update is all or nothing, and a refused delta leads to a full push."""

from __future__ import annotations

import pytest
import torch

from sync import (
    BaseVersionMismatch,
    ChecksumError,
    ManifestMismatch,
    ShardSpec,
    WeightSender,
    WeightSyncError,
    apply_update,
    merge_updates,
)
from contracts.weights import bucket_tensor
from tests.helpers import force_codec_path

pytestmark = pytest.mark.timeout(60)


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g),
        "model.norm.weight": torch.ones(16),
    }


def _step(w: dict[str, torch.Tensor], frac: float = 0.05, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in w.values():
        mask = (torch.rand(t.shape, generator=g) < frac).to(t.device)
        t[mask] += 0.05


def _engine(w: dict[str, torch.Tensor], dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v, dtype=dtype) for k, v in w.items()}


def _snapshot(e: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in e.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.bool else a[k], b[k]) for k in a)


def test_delta_refused_on_base_mismatch_then_full_push_succeeds() -> None:
    w, sender = _model(), WeightSender(mode="delta", bucket_bytes=1024)
    stale = _engine(w)  # never received version 1
    sender.encode(w, 1)
    _step(w)
    delta = sender.encode(w, 2)
    before = _snapshot(stale)
    with pytest.raises(BaseVersionMismatch) as info:
        apply_update(stale, delta, 0)
    assert isinstance(info.value, WeightSyncError)
    assert _same(stale, before)
    sender.force_full()
    full = sender.encode(w, 2)  # the same version again, now full
    assert full.manifest.kind == "full"
    assert apply_update(stale, full, 0) == 2
    assert _same(stale, {k: v.bfloat16() for k, v in w.items()})


@pytest.mark.parametrize("kind", ["full", "delta"])
@pytest.mark.parametrize("where", [0, -1])
def test_corrupted_payload_is_detected_and_weights_stay_old(kind: str, where: int) -> None:
    w, sender = _model(), WeightSender(mode="delta", bucket_bytes=512)
    engine = _engine(w)
    version = apply_update(engine, sender.encode(w, 1), 0)
    _step(w)
    if kind == "full":
        sender.force_full()
    update = sender.encode(w, 2)
    assert update.manifest.kind == kind
    bucket = bucket_tensor(update.buckets[where]).clone()
    entry = [e for e in update.manifest.entries if e.bucket == len(update.buckets) - 1 or where == 0][where]
    bucket[entry.offset + entry.nbytes // 2] ^= 0x10  # one flipped bit in the payload
    update.buckets[where if where >= 0 else len(update.buckets) - 1] = bucket
    before = _snapshot(engine)
    with pytest.raises(ChecksumError):
        apply_update(engine, update, version)
    assert _same(engine, before), "a refused update must leave the weights untouched"


def test_wrong_target_checksum_rolls_back_pieces_already_written() -> None:
    """Payloads intact but the receiver's base differs in a spot only the
    incremental checksum sees: earlier pieces must be rolled back."""
    w, sender = _model(), WeightSender(mode="delta", bucket_bytes=256)
    engine = _engine(w)
    apply_update(engine, sender.encode(w, 1), 0)
    _step(w, frac=0.3)
    update = sender.encode(w, 2)
    last = update.manifest.entries[-1]
    assert last.encoding == "sparse" and len(update.manifest.entries) > 2
    # make the receiver's base wrong exactly where the last piece changes something
    from sync.streams import decode_sparse
    from contracts.weights import dtype_from_name

    blob = bucket_tensor(update.buckets[last.bucket])[last.offset : last.offset + last.nbytes]
    flat = engine[last.name].view(-1)
    idx, _, _ = decode_sparse(blob, last.parts, last.index_codec, last.value_codec, last.count, last.num_changed,
                           lambda i: flat[i + last.start], dtype_from_name(last.dtype))
    flat[last.start + int(idx[0])] += 1.0
    before = _snapshot(engine)
    with pytest.raises(ChecksumError):
        apply_update(engine, update, 1)
    assert _same(engine, before)


def test_unknown_name_is_refused_before_anything_is_written() -> None:
    w = _model()
    engine = _engine(w)
    del engine["model.norm.weight"]
    before = _snapshot(engine)
    with pytest.raises(ManifestMismatch, match="model.norm.weight"):
        apply_update(engine, WeightSender(mode="full").encode(w, 1), 0)
    assert _same(engine, before)


@pytest.mark.parametrize("index", [0, 2])
def test_unknown_encoding_is_refused_and_nothing_is_written(index: int) -> None:
    import msgspec

    w = _model()
    engine = _engine(w)
    update = WeightSender(mode="full").encode(w, 1)
    entries = list(update.manifest.entries)
    entries[index] = msgspec.structs.replace(entries[index], encoding="zstd")
    update = msgspec.structs.replace(update, manifest=msgspec.structs.replace(update.manifest, entries=entries))
    before = _snapshot(engine)
    with pytest.raises(ManifestMismatch, match="unknown encoding 'zstd'"):
        apply_update(engine, update, 0)
    assert _same(engine, before)


def test_fp32_receiver_holds_the_bf16_weights_exactly() -> None:
    w, sender = _model(), WeightSender(mode="delta", dtype=torch.bfloat16)
    engine = _engine(w, dtype=torch.float32)
    v = apply_update(engine, sender.encode(w, 1), 0)
    for s in range(3):
        _step(w, seed=s)
        v = apply_update(engine, sender.encode(w, v + 1), v, verify="full")
    assert all(torch.equal(engine[k], w[k].bfloat16().float()) for k in w)


def test_receiver_that_would_round_the_update_refuses_it() -> None:
    w = _model()
    engine = _engine(w, dtype=torch.bfloat16)
    before = _snapshot(engine)
    with pytest.raises(ManifestMismatch, match="exactly"):
        apply_update(engine, WeightSender(mode="full", dtype=torch.float32).encode(w, 1), 0)
    assert _same(engine, before)


def test_tied_weights_are_sent_once() -> None:
    w = _model()
    w["lm_head.weight"] = w["model.embed_tokens.weight"]
    update = WeightSender(mode="full").encode(w, 1)
    assert "lm_head.weight" not in {e.name for e in update.manifest.entries}
    untied = WeightSender(mode="full", dedup_tied=False).encode(w, 1)
    assert "lm_head.weight" in {e.name for e in untied.manifest.entries}


def test_full_every_k_and_modes() -> None:
    w = _model()
    sender = WeightSender(mode="delta", full_every_k=3)
    kinds = []
    for v in range(1, 8):
        _step(w, seed=v)
        kinds.append(sender.encode(w, v).manifest.kind)
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    with pytest.raises(ValueError, match="mode"):
        WeightSender(mode="sparse")
    with pytest.raises(ValueError, match="greater"):
        sender.encode(w, 7)


def test_the_sender_is_built_from_its_sync_section_and_shares_its_defaults() -> None:
    from sync import SyncConfig

    default, cfg = WeightSender(), SyncConfig()
    assert (default.mode, default.bucket_bytes, default.full_every_k) == (cfg.mode, cfg.bucket_bytes, None)  # 0: never
    sender = WeightSender.from_config(SyncConfig(mode="full", bucket_bytes=4096, full_every_k=2), "float32",
                                      transport="ray")
    assert (sender.mode, sender.bucket_bytes, sender.full_every_k, sender.dtype) == ("full", 4096, 2, torch.float32)
    assert sender.transport == "ray"
    with pytest.raises(ValueError, match="'int8x'"):
        WeightSender.from_config(cfg, "int8x")


def _shard_pieces(w: dict[str, torch.Tensor], rank: int, world: int, dim_of) -> list:
    out = []
    for name, t in w.items():
        d = dim_of(t)
        size = t.shape[d] // world
        spec = ShardSpec(full_shape=tuple(t.shape), dim=d, offset=rank * size, length=size)
        out.append((name, t.narrow(d, rank * size, size).contiguous(), spec))
    return out


@pytest.mark.parametrize("dim_of", [lambda t: 0, lambda t: t.dim() - 1], ids=["rows", "columns"])
def test_sharded_senders_give_the_same_receiver_weights(dim_of) -> None:
    w = _model()
    w["model.norm.weight"] = torch.randn(16)
    senders = [WeightSender(mode="delta", bucket_bytes=300) for _ in range(2)]
    engine, ref_engine, ref = _engine(w), _engine(w), WeightSender(mode="delta", bucket_bytes=300)
    v = 0
    for step in range(3):
        if step:
            _step(w, seed=step)
        update = merge_updates([s.encode(_shard_pieces(w, r, 2, dim_of), v + 1) for r, s in enumerate(senders)])
        apply_update(ref_engine, ref.encode(w, v + 1), v, verify="full")
        v = apply_update(engine, update, v, verify="full")
        assert _same(engine, ref_engine)
    assert _same(engine, {k: t.bfloat16() for k, t in w.items()})


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("which", [0, 1, -1])
@pytest.mark.parametrize("forge", ["checksum", "count"])
def test_sparse_apply_undoes_a_piece_whose_target_checksum_is_wrong(path: str, which: int, forge: str,
                                                                     monkeypatch) -> None:
    """Sparse pieces are written before they are checked (on CPU by the C
    kernels, all at once on the pool, in the pass that sums them; by torch
    without them); a target checksum that does not match (or a count the
    stream does not hold) in any one piece must still leave every tensor as
    it was, and an intact update is bit-exact."""
    import msgspec

    force_codec_path(monkeypatch, path, min_part=7)
    w, sender = _model(), WeightSender(mode="delta", bucket_bytes=4096)
    engine = _engine(w)
    apply_update(engine, sender.encode(w, 1), 0)
    _step(w, frac=0.1)
    update = sender.encode(w, 2)
    sparse = [i for i, e in enumerate(update.manifest.entries) if e.encoding == "sparse"]
    assert sparse
    entries = list(update.manifest.entries)
    assert len(sparse) > 2
    bad = entries[sparse[which]]
    entries[sparse[which]] = (
        msgspec.structs.replace(bad, checksum=(bad.checksum[0] ^ 1, bad.checksum[1])) if forge == "checksum"
        else msgspec.structs.replace(bad, num_changed=bad.num_changed - 1))
    forged = type(update)(manifest=msgspec.structs.replace(update.manifest, entries=entries), buckets=update.buckets)
    before = _snapshot(engine)
    with pytest.raises(ChecksumError):
        apply_update(engine, forged, 1)
    assert _same(engine, before)
    assert apply_update(engine, update, 1, verify="full") == 2
    assert _same(engine, {k: v.bfloat16() for k, v in w.items()})


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("shard", [False, True])
def test_updates_on_a_device_are_exact_and_a_corrupt_one_changes_nothing(device: str, shard: bool) -> None:
    """On the GPU the checksums of a whole update are read back together:
    full and delta stay bit-exact, a flipped payload bit is still refused."""
    w = {k: v.to(device) for k, v in _model().items()}
    if shard:  # columns 4..11 of the embedding: a slice that is not contiguous in the full tensor
        spec = ShardSpec(full_shape=(64, 16), dim=1, offset=4, length=8)
        named = [(k, v, None) for k, v in w.items() if "embed" not in k]
        named.append(("model.embed_tokens.weight", w["model.embed_tokens.weight"][:, 4:12].contiguous(), spec))
    sender = WeightSender(mode="delta", bucket_bytes=512)
    engine = {k: v.to(torch.bfloat16) * 0 for k, v in w.items()}
    src = (lambda: named) if shard else (lambda: w)
    version = apply_update(engine, sender.encode(src(), 1), 0)
    for v in (2, 3):
        _step(w)
        if shard:
            named[-1] = (named[-1][0], w["model.embed_tokens.weight"][:, 4:12].contiguous(), spec)
        update = sender.encode(src(), v)
        assert update.manifest.kind == "delta"
        version = apply_update(engine, update, version, verify="full")
    expect = {k: t.to(torch.bfloat16) for k, t in w.items()}
    if shard:
        assert torch.equal(engine["model.embed_tokens.weight"][:, 4:12], expect["model.embed_tokens.weight"][:, 4:12])
        expect.pop("model.embed_tokens.weight")
    assert all(torch.equal(engine[k], t) for k, t in expect.items())
    sender.force_full()
    _step(w)
    if shard:
        named[-1] = (named[-1][0], w["model.embed_tokens.weight"][:, 4:12].contiguous(), spec)
    update = sender.encode(src(), 4)
    bucket = bucket_tensor(update.buckets[0]).clone()
    bucket[update.manifest.entries[0].nbytes // 2] ^= 0x10
    update.buckets[0] = bucket
    before = _snapshot(engine)
    with pytest.raises(ChecksumError):
        apply_update(engine, update, version)
    assert _same(engine, before)


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_a_pickled_update_carries_host_buckets_and_applies_on_the_device(device: str) -> None:
    """Another process (the driver between trainer and engine actors) gets
    the payload in host memory; the engine's apply moves it to its device."""
    import pickle

    w = {k: v.to(device) for k, v in _model().items()}
    sender = WeightSender(mode="delta", bucket_bytes=512)
    engine = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in w.items()}
    version = 0
    for v in (1, 2):
        update = pickle.loads(pickle.dumps(sender.encode(w, v)))
        assert all(not isinstance(b, torch.Tensor) or b.device.type == "cpu" for b in update.buckets)
        version = apply_update(engine, update, version)
        assert _same(engine, {k: t.to(torch.bfloat16) for k, t in w.items()})
        _step(w)
    assert update.manifest.kind == "delta" and version == 2


def test_a_receiver_drifted_where_a_delta_does_not_write_refuses_it_whole() -> None:
    """The delta's pieces are checked whole after writing: a drift at an element
    the delta leaves alone is caught (not only drifts where it writes), and the
    receiver is left exactly as it was."""
    w, sender = _model(), WeightSender(mode="delta", bucket_bytes=1024)
    engine = _engine(w)
    apply_update(engine, sender.encode(w, 1), 0)
    _step(w)
    delta = sender.encode(w, 2)
    e = next(e for e in delta.manifest.entries if e.num_changed < e.count)
    flat = engine[e.name].view(-1)[e.start : e.start + e.count]
    moved = (flat != w[e.name].view(-1)[e.start : e.start + e.count].bfloat16())
    untouched = int(torch.nonzero(~moved)[0])  # an element equal before and after: the delta does not write it
    flat[untouched] += 1.0
    before = _snapshot(engine)
    with pytest.raises(ChecksumError, match="result checksum mismatch"):
        apply_update(engine, delta, 1)
    assert _same(engine, before)
