"""Every transport round-trips an update; a 2-rank sharded trainer over gloo
gives the receiver exactly what an unsharded trainer gives it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from sync import ShardSpec, WeightSender, apply_update, merge_updates
from sync.transport import make_transport
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(90)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(24, 16, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 40, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
    }


def _step(w: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in w.values():
        t.add_(torch.randn(t.shape, generator=g) * 1e-3)


def _shard(w: dict[str, torch.Tensor], rank: int, world: int) -> list:
    """Column-parallel q_proj (dim 0), row-parallel down_proj (dim 1), norm replicated on rank 0."""
    out = []
    for name, t in w.items():
        if name.endswith("norm.weight"):
            if rank == 0:
                out.append((name, t, None))
            continue
        d = 0 if "q_proj" in name else 1
        n = t.shape[d] // world
        spec = ShardSpec(full_shape=tuple(t.shape), dim=d, offset=rank * n, length=n)
        out.append((name, t.narrow(d, rank * n, n).contiguous(), spec))
    return out


def _engine(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in w.items()}


def test_inproc_round_trip() -> None:
    w = _model(0)
    update = WeightSender(mode="full").encode(w, 1)
    t = make_transport("inproc")
    got = t.receive(t.send(update))
    engine = _engine(w)
    apply_update(engine, got, 0)
    assert all(torch.equal(engine[k], w[k].bfloat16()) for k in w)
    with pytest.raises(ValueError, match="unknown transport"):
        make_transport("carrier-pigeon")


def _gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        w = _model(0)  # every rank builds the same model; it trains only its shard
        sender = WeightSender(mode="delta", bucket_bytes=256)
        transports = [make_transport("broadcast", src=r) for r in range(world)]
        engine = _engine(w)
        version = 0
        for v in (1, 2, 3):
            if v > 1:
                _step(w, v)
            mine = sender.encode(_shard(w, rank, world), v)
            parts = [t.send(mine) or mine if r == rank else t.receive() for r, t in enumerate(transports)]
            version = apply_update(engine, merge_updates(parts), version, verify="full")
            kinds = {p.manifest.kind for p in parts}
            assert kinds == {"full" if v == 1 else "delta"}, kinds
        torch.save({k: v.view(torch.int16) for k, v in engine.items()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sharded_trainer_over_gloo_matches_unsharded(tmp_path) -> None:
    mp.spawn(_gloo_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    # the unsharded reference, in this process
    w = _model(0)
    sender, engine, version = WeightSender(mode="delta"), _engine(_model(0)), 0
    for v in (1, 2, 3):
        if v > 1:
            _step(w, v)
        version = apply_update(engine, sender.encode(w, v), version)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for k in w:
            assert torch.equal(got[k], engine[k].view(torch.int16)), (rank, k)


def _apply_remote(handle, shapes: dict[str, tuple[int, ...]], version: int, base: dict | None = None):
    engine = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()} if base is None else base
    return apply_update(engine, handle, version), engine


@pytest.mark.ray
def test_ray_object_store_round_trip_into_another_process(ray_cluster) -> None:
    ray = ray_cluster
    w = _model(1)
    sender = WeightSender(mode="delta", bucket_bytes=1024)
    transport = make_transport("ray")
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    remote_apply = ray.remote(_apply_remote)
    handle = transport.send(sender.encode(w, 1))
    assert len(handle.buckets) > 1
    version, engine = ray.get(remote_apply.remote(handle, shapes, 0))
    _step(w, 2)
    handle = transport.send(sender.encode(w, 2))
    assert handle.manifest.kind == "delta"
    version, engine = ray.get(remote_apply.remote(handle, shapes, version, engine))
    assert version == 2 and all(torch.equal(engine[k], w[k].bfloat16()) for k in w)
    local = _engine(w)
    full = transport.receive(transport.send(WeightSender(mode="full").encode(w, 2)))
    apply_update(local, full, 0)
    assert all(torch.equal(local[k], w[k].bfloat16()) for k in w)


def _ipc_worker(handle, shapes, queue) -> None:
    engine = {k: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for k, s in shapes.items()}
    apply_update(engine, handle, 0, verify="full")
    # numpy, not tensors: a torch tensor in a Queue is shared through this process,
    # which exits right after, before the parent could map it
    queue.put({k: v.cpu().view(torch.int16).numpy() for k, v in engine.items()})


@pytest.mark.gpu
def test_cuda_ipc_round_trip_between_processes() -> None:
    w = {k: v.cuda() for k, v in _model(2).items()}
    transport = make_transport("cuda_ipc")
    handle = transport.send(WeightSender(mode="full", bucket_bytes=1024).encode(w, 1))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_ipc_worker, args=(handle, {k: tuple(v.shape) for k, v in w.items()}, queue))
    p.start()
    got = queue.get(timeout=60)
    p.join(timeout=30)
    transport.release(handle)
    assert all(torch.equal(torch.from_numpy(got[k]), w[k].bfloat16().cpu().view(torch.int16)) for k in w)
