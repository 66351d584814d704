"""The torch trainer backend's optimizers: AdamW, or Muon for the hidden matrices
with AdamW for the rest (``trainer.optimizer``; docs/optimizers.md).

    build_optimizer(model, ...)     AdamW over every param, or MuonAdamW; under fp32 main
                                    params (bf16 model, one worker) inside MainParamsOptimizer;
                                    with trainer.mtp_lr the MTP modules in groups of their own
    muon_mask(model)                which params Muon steps: 2-D weights that are not an
                                    embedding or the output head (tied: one param, AdamW's)
    MuonAdamW                       torch.optim.Muon + torch.optim.AdamW behind one optimizer's
                                    step / zero_grad / state_dict / load_state_dict
    ShardedMuon                     FSDP2 (several workers): momentum on each rank's dim-0 shard,
                                    Newton-Schulz on the full matrix (gathered), the shard's rows kept

A step of Muon on a hidden weight ``W [A, B]`` with gradient ``G`` (torch's)::

    M = momentum * M + (1 - momentum) * G                       (state: M, one tensor per W)
    U = (1 - momentum) * G + momentum * M                       (Nesterov)
    O = NewtonSchulz5(U)                                        (~ the orthogonal factor of U, in bf16)
    W = W * (1 - lr * weight_decay) - lr * scale(A, B) * O

``trainer.muon.adjust_lr`` picks ``scale``: ``original`` sqrt(max(1, A/B)) (Keller Jordan's,
a Muon-sized lr ~0.02); ``match_rms_adamw`` 0.2 sqrt(max(A, B)) (Moonlight's: the update's
RMS ~0.2 lr, AdamW's typical one, so ``trainer.lr`` carries over);
``match_adamw_update_rms`` sqrt((1 - beta1) / (1 + beta1)) sqrt(max(A, B)), the RMS of AdamW's
update on noise-dominated gradients with its beta1 (0.229 at 0.9; verl's
``muon_match_adamw_update_rms``), run as ``match_rms_adamw`` with the group's lr scaled by
that factor / 0.2 and its weight decay by the inverse, so the decay ``lr * weight_decay`` is
the one the config gives.

Checkpoints: :meth:`MuonAdamW.state_dict` is one torch-format optimizer state over all
params in the model's order (Muon's groups first), so ``optimizer.pt``, FSDP2's gather /
re-shard of its state (``torch_fsdp``) and MainParamsOptimizer's wrapping work unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypedDict

import torch
from torch.distributed.tensor import DTensor, Replicate

from actors.backends.config import MuonConfig
from actors.backends.mixed_precision import MainParamsOptimizer

__all__ = ["MuonAdamW", "ShardedMuon", "build_optimizer", "muon_mask", "muon_unavailable"]

#: ``match_rms_adamw``'s constant in torch.optim.Muon (Moonlight's empirical AdamW update RMS).
_TORCH_RMS = 0.2
_MuonBase: type = getattr(torch.optim, "Muon", torch.optim.Optimizer)


def muon_unavailable() -> str | None:
    """Why this torch cannot run ``trainer.optimizer: muon``, or None."""
    if not hasattr(torch.optim, "Muon"):
        return f"it needs torch.optim.Muon (torch >= 2.9), and this torch is {torch.__version__}"
    return None


def muon_mask(model: torch.nn.Module) -> list[bool]:
    """For each of ``model.parameters()`` (in order): whether Muon steps it. Muon is for the
    hidden layers' matrices: 2-D weights, not an embedding (input, positional, or the output
    head, tied or not: their rows are per-token vectors, not a linear map to orthogonalise),
    norms or biases (1-D)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            embeddings.add(id(module.weight))
    return [p.ndim == 2 and id(p) not in embeddings for p in model.parameters()]


class ShardedMuon(_MuonBase):
    """``torch.optim.Muon`` for FSDP2's params (DTensors sharded on dim 0): the momentum
    stays on this rank's rows, the Nesterov update is gathered whole in bf16 (one
    all-gather per matrix; every rank calls :meth:`step` together), orthogonalised by
    torch's own Newton-Schulz on every rank alike, and this rank's rows of it applied:
    given the same gradients, bit for bit one worker's ``torch.optim.Muon`` step.
    Orthogonalising a shard instead would be another optimizer, one that changes with the
    worker count (on the tiny model's gradients, 60-80% of the update apart)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], object] | None = None) -> None:
        assert closure is None, "ShardedMuon takes no closure"
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # torch's, as its Muon runs them

        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                # torch's Newton-Schulz starts by rounding to bf16: gathering bf16 halves the bytes, same result
                update = update.bfloat16()
                full = update.full_tensor() if isinstance(update, DTensor) else update
                ortho = _zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"], group["eps"])
                if isinstance(p, DTensor):  # Replicate -> the param's Shard(0): a local slice, no collective
                    ortho = DTensor.from_local(ortho, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                               run_check=False).redistribute(p.device_mesh, p.placements)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class MuonAdamW:
    """Muon over the params ``use_muon`` marks, AdamW over the rest, as one optimizer.

    ``params`` in the model's order (``use_muon`` aligned with it). :meth:`state_dict`
    is torch's format over all of them: state keyed by the param's index in ``params``,
    Muon's groups then AdamW's, each listing those indices; :meth:`load_state_dict`
    takes it back and refuses another optimizer's (a plain AdamW checkpoint)."""

    def __init__(self, params: list[torch.Tensor], use_muon: list[bool],
                 make_muon: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 make_adamw: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        assert len(params) == len(use_muon), (len(params), len(use_muon))
        self._indices = ([i for i, m in enumerate(use_muon) if m], [i for i, m in enumerate(use_muon) if not m])
        if not self._indices[0]:
            raise ValueError("trainer.optimizer: muon found no 2-D hidden weights in this model to step")
        self.muon = make_muon([params[i] for i in self._indices[0]])
        self.adamw = make_adamw([params[i] for i in self._indices[1]]) if self._indices[1] else None

    @property
    def _parts(self) -> list[tuple[torch.optim.Optimizer, list[int]]]:
        parts = [(self.muon, self._indices[0])]
        return parts + ([(self.adamw, self._indices[1])] if self.adamw is not None else [])

    @property
    def param_groups(self) -> list[dict[str, object]]:
        return [g for opt, _ in self._parts for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt, _ in self._parts:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt, _ in self._parts:
            opt.step()

    def state_dict(self) -> dict[str, object]:
        state: dict[int, object] = {}
        groups: list[dict[str, object]] = []
        for opt, indices in self._parts:
            own = opt.state_dict()
            state.update({indices[k]: v for k, v in own["state"].items()})
            groups += [{**g, "params": [indices[k] for k in g["params"]]} for g in own["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups, start = state_dict.get("param_groups", []), 0
        parts = []
        for opt, indices in self._parts:
            mine = groups[start : start + len(opt.param_groups)]
            start += len(opt.param_groups)
            if sorted(i for g in mine for i in g["params"]) != indices:
                raise ValueError("optimizer state is not a Muon + AdamW one of this model "
                                 "(saved with another trainer.optimizer, or another model)")
            parts.append((opt, mine))
        if start != len(groups):
            raise ValueError(f"optimizer state has {len(groups)} param groups, Muon + AdamW here {start}")
        for opt, mine in parts:
            ids = [i for g in mine for i in g["params"]]
            opt.load_state_dict({"state": {i: state_dict["state"][i] for i in ids if i in state_dict["state"]},
                                 "param_groups": mine})


class _MuonGroup(TypedDict):
    """torch.optim.Muon's keywords that ``muon.adjust_lr`` sets."""

    lr: float
    weight_decay: float
    adjust_lr_fn: str


def _muon_group(muon: MuonConfig, lr: float, betas: tuple[float, float], weight_decay: float) -> _MuonGroup:
    """torch.optim.Muon's lr, weight decay and ``adjust_lr_fn`` for ``muon.adjust_lr`` (module docstring)."""
    lr = muon.lr if muon.lr is not None else lr
    if muon.adjust_lr != "match_adamw_update_rms":
        return {"lr": lr, "weight_decay": weight_decay, "adjust_lr_fn": muon.adjust_lr}
    ratio = math.sqrt((1 - betas[0]) / (1 + betas[0])) / _TORCH_RMS
    return {"lr": lr * ratio, "weight_decay": weight_decay / ratio, "adjust_lr_fn": "match_rms_adamw"}


def build_optimizer(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                    muon: MuonConfig | None, fused: bool, sharded: bool, master_dtype: torch.dtype | None,
                    mtp_lr: float | None = None) -> torch.optim.Optimizer | MuonAdamW | MainParamsOptimizer:
    """The optimizer over ``model.parameters()``: AdamW (``muon`` None) or :class:`MuonAdamW`;
    ``fused``: AdamW's one-kernel CUDA step; ``sharded``: FSDP2's DTensors (:class:`ShardedMuon`);
    ``master_dtype``: wrapped in :class:`MainParamsOptimizer` over copies in that dtype;
    ``mtp_lr``: the MTP modules' params (``mtp.*``) in groups of their own (:func:`_mtp_groups`)."""
    optimizer = _build(model, lr=lr, betas=betas, weight_decay=weight_decay, muon=muon, fused=fused,
                       sharded=sharded, master_dtype=master_dtype)
    if mtp_lr is not None:
        _mtp_groups(optimizer, model, mtp_lr / lr)
    return optimizer


def _mtp_groups(optimizer: torch.optim.Optimizer | MuonAdamW | MainParamsOptimizer, model: torch.nn.Module,
                scale: float) -> None:
    """Move the MTP modules' params of each torch optimizer inside ``optimizer`` (AdamW's, or
    Muon's and AdamW's) into a second group whose lr is the first's times ``scale``. The modules
    come last in the model's param order, so each optimizer's params stay in that order across its
    groups: its state's indices, which checkpoints and FSDP2's re-shard read, do not move."""
    names = [n for n, _ in model.named_parameters()]
    is_mtp = [n.startswith("mtp.") for n in names]
    if True not in is_mtp or not all(is_mtp[is_mtp.index(True):]):
        raise ValueError("trainer.mtp_lr: the model's MTP params (mtp.*) must exist and come last in its params")
    inner = optimizer.optimizer if isinstance(optimizer, MainParamsOptimizer) else optimizer
    held = optimizer.main if isinstance(optimizer, MainParamsOptimizer) else list(model.parameters())
    mtp = {id(t) for t, m in zip(held, is_mtp) if m}
    parts = [inner.muon, inner.adamw] if isinstance(inner, MuonAdamW) else [inner]
    for opt in (o for o in parts if o is not None):
        (group,) = opt.param_groups
        moved = [p for p in group["params"] if id(p) in mtp]
        if moved:
            group["params"] = [p for p in group["params"] if id(p) not in mtp]
            opt.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": moved,
                                 "lr": group["lr"] * scale})


def _build(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
           muon: MuonConfig | None, fused: bool, sharded: bool,
           master_dtype: torch.dtype | None) -> torch.optim.Optimizer | MuonAdamW | MainParamsOptimizer:

    def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None)

    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer | MuonAdamW] = adamw
    if muon is not None:
        if (reason := muon_unavailable()) is not None:
            raise ValueError(f"trainer.optimizer: muon is not available here: {reason}")
        group = _muon_group(muon, lr, betas, weight_decay)
        cls = ShardedMuon if sharded else torch.optim.Muon
        make = functools.partial(MuonAdamW, use_muon=muon_mask(model), make_adamw=adamw,
                                 make_muon=lambda ps: cls(ps, momentum=muon.momentum, nesterov=True, **group))
    if master_dtype is None:
        return make(list(model.parameters()))
    return MainParamsOptimizer(model.parameters(), make, master_dtype)
