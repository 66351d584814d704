"""The device fast path of a full push (sync/device.py): same checksums and
bytes as the generic path, refused payloads leave the receiver untouched, and
a receiver whose tensors change rebuilds its plan. On CPU it runs with
``device_plan="always"`` and the torch block sums; the GPU tests run the
Triton kernel and CUDA IPC between processes."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from contracts.weights import ShardSpec
from sync import WeightSender, apply_update
from sync import apply as sync_apply
from sync import codec, device
from sync.errors import ChecksumError


def _weights(seed: int = 0, dev: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"embed": torch.randn(300, 70, generator=g), "norm": torch.randn(5000, generator=g),
         "proj": torch.randn(17, 3, generator=g)}
    w = {k: v.to(dev) for k, v in w.items()}
    w["lm_head"] = w["embed"]  # tied: sent once
    return w


def _receiver(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=torch.bfloat16, device=v.device) for k, v in w.items() if k != "lm_head"}


def _sender(plan: str, **kw) -> WeightSender:
    return WeightSender(mode=kw.pop("mode", "full"), bucket_bytes=8192, dtype=torch.bfloat16, device_plan=plan, **kw)


def test_planned_full_matches_the_generic_checksums_and_applies() -> None:
    w = _weights()
    generic, planned = _sender("never").encode(w, 1), _sender("always").encode(w, 1)
    assert planned.manifest.layout and not generic.manifest.layout
    sums = lambda u: {(e.name, e.start, e.count): e.checksum for e in u.manifest.entries}  # noqa: E731
    assert sums(planned) == sums(generic)
    for verify in ("incremental", "full"):  # the planned receiver, then the generic one (verify=full)
        recv = _receiver(w)
        assert apply_update(recv, planned, 0, verify=verify) == 1
        assert all(torch.equal(recv[k], w[k].bfloat16()) for k in recv)
        planned_here = any(p.still_valid(recv) for p in sync_apply._PLANS.get(planned.manifest.layout, []))
        assert planned_here == (verify == "incremental")


def test_planned_payload_corruption_is_refused_and_nothing_written() -> None:
    w = _weights()
    sender, recv = _sender("always"), _receiver(w)
    apply_update(recv, sender.encode(w, 1), 0)
    with torch.no_grad():
        w["norm"].add_(1.0)
    update = sender.encode(w, 2)
    e = next(e for e in update.manifest.entries if e.name == "norm")
    update.buckets[e.bucket][e.offset + 3] ^= 1
    before = {k: v.clone() for k, v in recv.items()}
    with pytest.raises(ChecksumError, match=r"norm\[0:4096\]: payload checksum mismatch"):
        apply_update(recv, update, 1)
    assert all(torch.equal(recv[k], before[k]) for k in recv)


def test_buckets_are_reused_and_new_receiver_tensors_rebuild_the_plan() -> None:
    w = _weights()
    sender, recv = _sender("always"), _receiver(w)
    first = sender.encode(w, 1)
    apply_update(recv, first, 0)
    with torch.no_grad():
        w["proj"].mul_(2)
    plan = sender._plan
    second = sender.encode({k: v.detach() for k, v in w.items()}, 2)  # fresh views, as trainers hand over
    assert sender._plan is plan
    assert [b.data_ptr() for b in second.buckets] == [b.data_ptr() for b in first.buckets]
    recv = {k: v.clone() for k, v in recv.items()}  # an engine that reloaded its weights
    apply_update(recv, second, 1)
    assert all(torch.equal(recv[k], w[k].bfloat16()) for k in recv)
    plans = list(sync_apply._PLANS[second.manifest.layout])
    apply_update(dict(recv), second, 2)  # a new dict of the same tensors (as engines pass): the same plan
    assert sync_apply._PLANS[second.manifest.layout] == plans
    w["extra"] = torch.randn(40)  # the sender's tensors change: a new layout, and its old plan here goes
    recv["extra"] = torch.zeros(40, dtype=torch.bfloat16)
    third = sender.encode(w, 3)
    apply_update(recv, third, 2)
    assert third.manifest.layout != second.manifest.layout
    assert not any(p.still_valid(recv) for p in sync_apply._PLANS.get(second.manifest.layout, []))


def test_delta_after_a_planned_full_is_exact() -> None:
    w = _weights()
    sender, recv = _sender("always", mode="delta"), _receiver(w)
    apply_update(recv, sender.encode(w, 1), 0)
    with torch.no_grad():
        w["norm"] += 1.0
    sender.force_full()  # a second planned full: the storage, not the last-sent copy, holds version 2
    apply_update(recv, sender.encode(w, 2), 1)
    with torch.no_grad():
        w["embed"][3] += 0.5
    delta = sender.encode(w, 3)
    assert delta.manifest.kind == "delta" and delta.manifest.layout and 0 < delta.manifest.num_changed <= 70
    apply_update(recv, delta, 2)
    assert all(torch.equal(recv[k], w[k].bfloat16()) for k in recv)


def test_contiguous_shards_go_through_the_plan() -> None:
    full = torch.randn(8, 600)
    shards = [("w", full[:5], ShardSpec(full_shape=(8, 600), offset=0, length=5)),
              ("w", full[5:], ShardSpec(full_shape=(8, 600), offset=5, length=3))]
    update = _sender("always").encode(shards, 1)
    assert update.manifest.layout
    recv = {"w": torch.zeros(8, 600, dtype=torch.bfloat16)}
    apply_update(recv, update, 0)
    assert torch.equal(recv["w"], full.bfloat16())


def test_block_sums_match_the_checksum_definition() -> None:
    x = torch.randint(-(2**15), 2**15, (3 * device.BLOCK,), dtype=torch.int16)
    got = device.block_sums(x)
    for b in range(3):
        blk = x[b * device.BLOCK : (b + 1) * device.BLOCK].to(torch.int64)
        assert got[b, 0] == blk.sum() and got[b, 1] == (blk * torch.arange(device.BLOCK)).sum()


def test_a_layout_digest_that_does_not_match_takes_the_generic_path() -> None:
    w = _weights()
    update = _sender("always").encode(w, 1)
    update.manifest.layout = "0" * 32  # lies about its layout: checked the generic way, still applied
    recv = _receiver(w)
    apply_update(recv, update, 0)
    assert not sync_apply._PLANS.get("0" * 32) and all(torch.equal(recv[k], w[k].bfloat16()) for k in recv)


# ---------------------------------------------------------------- planned deltas


def _step(w: dict[str, torch.Tensor], seed: int, frac: float = 0.05) -> None:
    """Move a random ``frac`` of every tensor's elements (lm_head stays tied)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, v in w.items():
            if k != "lm_head":
                hit = (torch.rand(v.shape, generator=g) < frac).to(v.device)
                v.add_(hit * torch.randn(v.shape, generator=g).to(v.device))


def _exact(recv: dict[str, torch.Tensor], w: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(recv[k], w[k].to(recv[k].dtype)) for k in recv)


def test_planned_delta_is_an_ordinary_delta_that_any_receiver_applies() -> None:
    w = _weights()
    planned, generic = _sender("always", mode="delta"), _sender("never", mode="delta")
    recv, recv_generic = _receiver(w), _receiver(w)
    apply_update(recv, planned.encode(w, 1), 0)
    apply_update(recv_generic, generic.encode(w, 1), 0)
    for version in (2, 3, 4):
        _step(w, version)
        update, reference = planned.encode(w, version), generic.encode(w, version)
        m = update.manifest
        assert m.kind == "delta" and m.layout and m.base_version == version - 1
        assert {(e.encoding, e.index_codec, e.value_codec) for e in m.entries} == {("sparse", "bitmask", "raw")}
        assert m.num_changed == reference.manifest.num_changed > 0
        pieces = lambda u: {(e.name, e.start): (e.num_changed, e.checksum) for e in u.manifest.entries}  # noqa: E731
        assert pieces(update) == pieces(reference)  # the same changes, the same target checksums
        assert apply_update(recv, update, version - 1) == version  # generic receiver: payload checksums checked
        assert _exact(recv, w)
    unchanged = planned.encode(w, 5)  # nothing moved: an empty delta still advances the version
    assert unchanged.manifest.entries == [] and apply_update(recv, unchanged, 4) == 5


def test_planned_delta_buckets_cut_at_piece_boundaries_and_reuse_the_payload() -> None:
    w = _weights()
    sender, recv = _sender("always", mode="delta"), _receiver(w)
    apply_update(recv, sender.encode(w, 1), 0)
    ptrs = []
    for version in (2, 3):
        _step(w, version, frac=0.9)  # most elements: blobs near a piece's raw size, several buckets
        update = sender.encode(w, version)
        m = update.manifest
        assert len(m.bucket_sizes) > 1 and max(m.bucket_sizes) <= 8192 * 1.2
        assert device.contiguous_region(update.buckets, m.bucket_sizes) is not None
        ptrs.append(update.buckets[0].data_ptr())
        apply_update(recv, update, version - 1)
        assert _exact(recv, w)
    assert ptrs[0] == ptrs[1]


def test_planned_delta_corruption_is_refused_and_nothing_written() -> None:
    w = _weights()
    sender, recv = _sender("always", mode="delta"), _receiver(w)
    apply_update(recv, sender.encode(w, 1), 0)
    _step(w, 2)
    update = sender.encode(w, 2)
    e = update.manifest.entries[0]
    update.buckets[e.bucket][e.offset + e.nbytes - 1] ^= 1  # a value byte
    before = {k: v.clone() for k, v in recv.items()}
    with pytest.raises(ChecksumError):
        apply_update(recv, update, 1)
    assert _exact(recv, before)


def test_planned_delta_reverts_and_follows_a_generic_encode() -> None:
    w = _weights()
    sender, recv = _sender("always", mode="delta"), _receiver(w)
    apply_update(recv, sender.encode(w, 1), 0)
    before = {k: v.clone() for k, v in recv.items()}
    _step(w, 2)
    apply_update(recv, sender.encode(w, 2), 1)
    undo = sender.revert_update()
    assert undo.manifest.layout and undo.manifest.base_version == 2 and undo.manifest.version == 1
    assert apply_update(recv, undo, 2) == 1 and _exact(recv, before)
    assert sender.revert_update() is None  # one step back only
    # tensors the plan was not built for go the generic way; the next planned delta starts from them
    moved = {k: (v.clone() if k == "norm" else v) for k, v in w.items()}
    _step(moved, 3)
    generic = sender.encode(moved, 2)
    assert not generic.manifest.layout
    apply_update(recv, generic, 1)
    with torch.no_grad():
        for k in w:
            w[k].copy_(moved[k])
    _step(w, 4)
    update = sender.encode(w, 3)
    assert update.manifest.layout and update.manifest.kind == "delta"
    apply_update(recv, update, 2)
    assert _exact(recv, w)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_triton_block_sums_equal_torch() -> None:
    x = torch.randint(-(2**15), 2**15, (4096 * device.BLOCK,), dtype=torch.int16, device="cuda")
    fallback = device._KERNEL
    got = device.block_sums(x)
    device._KERNEL = False  # force the torch path
    try:
        want = device.block_sums(x)
    finally:
        device._KERNEL = fallback
    assert torch.equal(got, want)


def _ipc_receiver(shapes: dict, conn) -> None:
    from sync.transport import make_transport

    transport = make_transport("cuda_ipc")
    recv = {k: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for k, s in shapes.items()}
    version = 0
    while (handle := conn.recv()) is not None:
        try:
            # checked ahead (a full one; as a rollout actor does before the pause), then applied
            staged = sync_apply.stage_update(recv, transport.receive(handle))
            update = transport.receive(handle)
            version = apply_update(recv, update, version)
            m = update.manifest
            keys = [(e.name, e.shard, e.start, e.count) for e in m.entries]
            planned = (staged and any(p.still_valid(recv) for p in sync_apply._PLANS.get(m.layout, []))
                       if m.kind == "full"
                       else any(p.find(recv, keys) is not None for p in codec._DELTA_PLANS.get(m.layout, [])))
            conn.send((version if planned else -1, {k: v.cpu().view(torch.int16).numpy() for k, v in recv.items()}))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            conn.send((version, repr(exc)))


@pytest.mark.gpu
def test_planned_pushes_over_cuda_ipc_between_processes() -> None:
    from sync.transport import make_transport

    w = _weights(dev="cuda")
    shapes = {k: tuple(v.shape) for k, v in w.items() if k != "lm_head"}
    sender, transport = WeightSender(mode="full", bucket_bytes=8192), make_transport("cuda_ipc")
    here, there = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_ipc_receiver, args=(shapes, there))
    proc.start()
    try:
        for version in (1, 2, 3, 4, 5, 6):
            sender.mode = "full" if version <= 3 else "delta"  # full pushes, then planned deltas
            _step(w, version)
            update = sender.encode(w, version)
            assert update.manifest.layout and update.manifest.kind == sender.mode
            handle = transport.send(update)
            here.send(handle)
            got_version, got = here.recv()
            transport.release(handle)
            assert got_version == version, got  # -1: applied, but not on the receiver's planned (or staged) path
            assert all(torch.equal(torch.from_numpy(got[k]), w[k].bfloat16().cpu().view(torch.int16)) for k in shapes)
        here.send(None)
    finally:
        proc.join(timeout=60)


@pytest.mark.gpu
def test_planned_delta_kernels_write_the_torch_paths_bytes() -> None:
    from sync import device_delta

    w = _weights(dev="cuda")
    senders = [_sender("auto", mode="delta"), _sender("auto", mode="delta")]
    for s in senders:
        s.encode(w, 1)
    _step(w, 2, frac=0.3)
    got = senders[0].encode(w, 2)
    kernels, device_delta._K = device_delta._K, False  # the second sender packs with torch
    try:
        want = senders[1].encode(w, 2)
    finally:
        device_delta._K = kernels
    assert got.manifest.entries == want.manifest.entries and got.manifest.bucket_sizes == want.manifest.bucket_sizes
    blob = lambda u, e: u.buckets[e.bucket][e.offset : e.offset + e.nbytes]  # noqa: E731 - gaps between are not written
    assert all(torch.equal(blob(got, e), blob(want, e)) for e in got.manifest.entries)
    assert torch.equal(senders[0]._plan.values, senders[1]._plan.values)  # last-sent moved alike


@pytest.mark.gpu
def test_planned_delta_receiver_kernels_check_everything_before_writing() -> None:
    w = _weights(dev="cuda")
    sender, recv = _sender("auto", mode="delta"), _receiver(w)
    apply_update(recv, sender.encode(w, 1), 0)
    for version in (2, 3):
        _step(w, version)
        update = sender.encode(w, version)
        assert apply_update(recv, update, version - 1) == version and _exact(recv, w)
        keys = [(e.name, e.shard, e.start, e.count) for e in update.manifest.entries]
        assert any(p.find(recv, keys) is not None for p in codec._DELTA_PLANS[update.manifest.layout])
    with torch.no_grad():  # a delta that leaves pieces out: the same plan covers it
        w["proj"][0, 0] += 1.0
    plans = list(codec._DELTA_PLANS[update.manifest.layout])
    update = sender.encode(w, 4)
    assert [e.name for e in update.manifest.entries] == ["proj"]
    apply_update(recv, update, 3)
    assert _exact(recv, w) and codec._DELTA_PLANS[update.manifest.layout] == plans
    sender.revert_update()  # (engines would apply it; here the sender just goes back to version 3)
    with torch.no_grad():
        w["proj"][0, 0] -= 1.0
    recv["proj"].copy_(w["proj"])
    _step(w, 4)
    update = sender.encode(w, 4)
    e = update.manifest.entries[0]
    before = {k: v.clone() for k, v in recv.items()}
    update.buckets[e.bucket][e.offset + e.nbytes - 1] ^= 1  # a value byte
    with pytest.raises(ChecksumError, match="target checksum"):
        apply_update(recv, update, 3)
    assert _exact(recv, before)
    update.buckets[e.bucket][e.offset + e.nbytes - 1] ^= 1
    # a receiver drifted at an element the delta does not touch: the whole piece's base is checked
    flat = recv[e.name].view(-1)
    mask = update.buckets[e.bucket][e.offset : e.offset + e.parts[0]].cpu()
    unchanged = next(i for i in range(e.count) if not (int(mask[i // 8]) >> (i % 8)) & 1)
    flat[e.start + unchanged] += 1
    before = {k: v.clone() for k, v in recv.items()}
    with pytest.raises(ChecksumError, match="differ from the base version"):
        apply_update(recv, update, 3)
    assert _exact(recv, before)


def _count_checks(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = device._PieceSums.__call__
    monkeypatch.setattr(device._PieceSums, "__call__", lambda self, v: calls.append(1) or real(self, v))
    return calls


def test_a_staged_full_update_is_checked_once_and_its_apply_only_copies(monkeypatch) -> None:
    w = _weights()
    sender, recv = _sender("always"), _receiver(w)
    update = sender.encode(w, 1)
    checks = _count_checks(monkeypatch)
    assert sync_apply.stage_update(recv, update)
    assert all(not v.any() for v in recv.values()) and len(checks) == 1  # checked, nothing written
    assert apply_update(recv, update, 0) == 1
    assert len(checks) == 1  # the apply copied at once
    assert all(torch.equal(recv[k], w[k].bfloat16()) for k in recv)
    with torch.no_grad():
        w["norm"].add_(1.0)
    second = sender.encode(w, 2)
    checks.clear()
    apply_update(recv, second, 1)  # not staged: the apply checks
    assert len(checks) == 1 and torch.equal(recv["norm"], w["norm"].bfloat16())


def test_a_stage_stands_only_for_the_update_it_checked(monkeypatch) -> None:
    w = _weights()
    sender, recv = _sender("always"), _receiver(w)
    first = sender.encode(w, 1)
    assert sync_apply.stage_update(recv, first)
    with torch.no_grad():
        w["norm"].add_(1.0)
    second = sender.encode(w, 2)  # same buckets, other bytes and checksums
    e = next(e for e in second.manifest.entries if e.name == "norm")
    second.buckets[e.bucket][e.offset + 3] ^= 1
    with pytest.raises(ChecksumError, match="payload checksum mismatch"):
        apply_update(recv, second, 0)  # checked again: refused, nothing written
    assert all(not v.any() for v in recv.values())
    with pytest.raises(ChecksumError):
        sync_apply.stage_update(recv, second)
    with pytest.raises(ChecksumError):
        apply_update(recv, second, 0)  # a failed stage is not remembered as a pass


def test_only_planned_full_updates_are_staged() -> None:
    w = _weights()
    recv = _receiver(w)
    assert not sync_apply.stage_update(recv, _sender("never").encode(w, 1))  # generic: the apply checks
    sender = _sender("always", mode="delta")
    apply_update(recv, sender.encode(w, 1), 0)
    with torch.no_grad():
        w["proj"].mul_(2)
    delta = sender.encode(w, 2)
    assert delta.manifest.kind == "delta" and not sync_apply.stage_update(recv, delta)
