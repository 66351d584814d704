"""Data parallel for the torch trainer backend: FSDP2 over the default
``torch.distributed`` group, the slices each rank holds, and checkpoints that
are the same files whatever the world size.

    shard_model(model, ...)       each decoder layer, then the root, ``fully_shard``-ed (dim 0,
                                  uneven like ``torch.chunk``); gradients reduced as a SUM
    live_tensors(model)           (name, live tensor, name it is tied to) in ``state_dict()`` order
    shard_spec(t, rank, world)    which slice of the full tensor a rank holds (a ShardSpec)
    save_sharded / load_sharded   full tensors gathered to rank 0 and written; read by every
                                  rank, each keeping its slices (a shared filesystem)

The checkpoint holds the weights in the model dtype and the optimizer state
(and the fp32 main params when the model dtype is lower) as
``MainParamsOptimizer`` writes them, so it resumes at any world size.
"""

from __future__ import annotations

import pathlib

import safetensors.torch
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from actors.backends.base import Loss, write_trainer_state
from contracts.weights import ShardSpec

__all__ = ["live_tensors", "load_sharded", "local_shard", "save_sharded", "shard_model", "shard_spec"]


def shard_spec(t: torch.Tensor, rank: int, world_size: int) -> ShardSpec:
    """The slice of ``t``'s full tensor that ``rank`` holds: FSDP2 splits dim 0
    like ``torch.chunk`` (ceil-sized chunks, the last ranks' shorter or empty).
    A tensor FSDP does not shard (a buffer) is rank 0's whole and others' empty."""
    full_shape = tuple(t.shape)
    if not full_shape:
        raise ValueError("a 0-dim weight cannot be described by a ShardSpec")
    rows = full_shape[0]
    if isinstance(t, DTensor):
        assert tuple(t.placements) == (Shard(0),), t.placements
        chunk = -(-rows // world_size)
        offset = min(rank * chunk, rows)
        length = min(chunk, rows - offset)
        assert t.to_local().shape[0] == length, (full_shape, rank, t.to_local().shape)
    else:
        offset, length = 0, rows if rank == 0 else 0
    return ShardSpec(full_shape=full_shape, dim=0, offset=offset, length=length)


def local_shard(t: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The part of live tensor ``t`` that ``spec`` describes, detached (a view)."""
    if isinstance(t, DTensor):
        return t.to_local().detach()
    return t.detach().narrow(0, spec.offset, spec.length)


def shard_model(model: transformers.PreTrainedModel, device_type: str, world_size: int, dtype: torch.dtype,
                master_dtype: torch.dtype | None) -> None:
    """FSDP2 over the default group: each decoder layer, then the root (which
    takes the rest, the tied embedding / lm_head among it, so they stay one
    parameter)."""
    mesh = init_device_mesh(device_type, (world_size,))
    # Mixed precision is FSDP2's own: the sharded params (what AdamW steps) stay in
    # master_dtype, are cast to the model dtype when all-gathered for compute, and
    # their grads are reduced and accumulated in master_dtype. That is the sharded
    # form of MainParamsOptimizer (fp32 main params, bf16 compute) without keeping
    # a second copy; the engines get the same bf16 rounding of the fp32 params.
    policy = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=master_dtype)
              if master_dtype is not None else MixedPrecisionPolicy())
    layer_types = set(getattr(model, "_no_split_modules", None) or ())  # HF: the decoder layer class
    for module in list(model.modules()):
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not average: each rank's loss is already scaled by its share of
            # the global token count, so the sum is the whole batch's token mean.
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_gradient_divide_factor(1.0)
                # a plain SUM, not NCCL's PREMUL_SUM by 1.0, which gloo lacks
                module.set_force_sum_reduction_for_comms(True)
            else:  # torch < 2.8 (untested here): NCCL only
                module.set_reduce_scatter_divide_factor(1.0)


def live_tensors(model: transformers.PreTrainedModel) -> list[tuple[str, torch.Tensor, str | None]]:
    """``(name, live tensor, name it is tied to or None)`` for every entry of
    ``state_dict()``, in its order; sharded params are the live DTensors."""
    model.reshard()  # the root keeps its params unsharded after a no-grad forward
    live = dict(model.named_parameters(remove_duplicate=False))
    live.update(model.named_buffers(remove_duplicate=False))
    first: dict[int, str] = {}
    out = []
    for name in model.state_dict(keep_vars=True):
        t = live[name]
        out.append((name, t, first.get(id(t))))
        first.setdefault(id(t), name)
    return out


def _gathered(t: torch.Tensor, rank: int) -> torch.Tensor | None:
    """The full ``t`` on rank 0 (host memory), None on the others; every rank must call it."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.detach().cpu() if rank == 0 else None


def save_sharded(model: transformers.PreTrainedModel, optimizer: torch.optim.Optimizer, path: pathlib.Path, *,
                 rank: int, dtype: torch.dtype, master_dtype: torch.dtype | None, version: int, loss: Loss) -> None:
    """Every rank takes part in the gathers; rank 0 writes the checkpoint files
    (``version`` and ``loss`` in ``trainer_state.json``)."""
    full: dict[str, torch.Tensor | None] = {}
    for name, t, tied in live_tensors(model):
        full[name] = full[tied] if tied is not None else _gathered(t, rank)
    optim = optimizer.state_dict()
    optim["state"] = {i: {k: _gathered(v, rank) if isinstance(v, DTensor) else v for k, v in st.items()}
                      for i, st in optim["state"].items()}
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        weights: dict[str, torch.Tensor] = {}
        for name, t, tied in live_tensors(model):
            w = full[name] if tied is None else weights[tied]
            weights[name] = w.to(dtype) if tied is None and w.is_floating_point() else w
        model.save_pretrained(path, state_dict=weights, safe_serialization=True)
        if master_dtype is not None:
            # save_pretrained wrote the params' dtype (the main params'); the weights are the model dtype's
            model.config.dtype = dtype
            model.config.save_pretrained(path)
            optim = {"optimizer": optim, "main_params": [full[n] for n, _ in model.named_parameters()]}
        torch.save(optim, path / "optimizer.pt")
        write_trainer_state(path, version, loss)
    dist.barrier()  # nobody reads the checkpoint before rank 0 has written it


@torch.no_grad()
def load_sharded(model: transformers.PreTrainedModel, optimizer: torch.optim.Optimizer, path: pathlib.Path, *,
                 specs: dict[str, ShardSpec], master_dtype: torch.dtype | None) -> None:
    """Every rank reads what :func:`save_sharded` wrote and keeps its slices of
    the weights, the main params and the optimizer state."""
    state = safetensors.torch.load_file(str(path / "model.safetensors"), device="cpu")
    live = live_tensors(model)
    # A tied lm_head is saved once, under the embedding's name.
    missing = [n for n, _, tied in live if n not in state and (tied is None or tied not in state)]
    unexpected = sorted(set(state) - {n for n, _, _ in live})
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(path)!r} does not match the model: missing {missing}, unexpected {unexpected}")
    for name, t, _ in live:
        if name in state:
            _write_slice(t, state[name], name, path, specs)
    saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    named = list(model.named_parameters())
    if (master_dtype is not None) != ("main_params" in saved):
        raise ValueError(f"checkpoint {str(path)!r}: its optimizer state is {'' if 'main_params' in saved else 'not '}"
                         f"a mixed-precision one (fp32 main params), this backend's is the other kind")
    if master_dtype is not None:
        if len(saved["main_params"]) != len(named):
            raise ValueError(f"checkpoint {str(path)!r} has {len(saved['main_params'])} main params for {len(named)} parameters")
        for (name, p), main in zip(named, saved["main_params"]):
            _write_slice(p, main, name, path, specs)  # exact: the safetensors hold them rounded
        saved = saved["optimizer"]
    for i, (name, p) in enumerate(named):  # keep this rank's slice of each full state tensor
        spec = specs[name]
        for k, v in saved["state"].get(i, {}).items():
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape:
                local = v.narrow(0, spec.offset, spec.length).to(p.device).contiguous()
                saved["state"][i][k] = DTensor.from_local(local, p.device_mesh, p.placements,
                                                          shape=p.shape, stride=p.stride())
    optimizer.load_state_dict(saved)


def _write_slice(t: torch.Tensor, full: torch.Tensor, name: str, path: pathlib.Path,
                 specs: dict[str, ShardSpec]) -> None:
    """Copy this rank's part of ``full`` into live tensor ``t`` (a shard or a whole buffer)."""
    if tuple(full.shape) != tuple(t.shape):
        raise ValueError(f"checkpoint {str(path)!r} has {name} of shape {tuple(full.shape)}, the model {tuple(t.shape)}")
    if isinstance(t, DTensor):
        spec = specs[name]
        t.to_local().copy_(full.narrow(0, spec.offset, spec.length))
    else:
        t.copy_(full)
