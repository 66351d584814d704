"""The Megatron backend's weights and optimizer state under Hugging Face names:
what a weight sync pushes, and checkpoints in the torch backend's format.

    named_weights() / shard_specs()   Megatron params ─► HF names: this rank's slices (q/k/v split
                                      out of the fused qkv, gate/up out of fc1; megatron_convert)
    save(dir)                         TP parts gathered ─► HF config + model.safetensors, and the
                                      optimizer state (Adam moments, fp32 main params when mixed)
                                      mapped to HF names in the torch backend's optimizer.pt format
    load(dir)                         the same files (either backend's) ─► this rank's TP part

Optimizer state, keyed by HF name as the torch backend's ``optimizer.pt`` holds it:
``{name: {"exp_avg", "exp_avg_sq", "step", and "param" (the fp32 main param) when mixed}}``.
With Megatron's distributed optimizer each data-parallel rank holds a range of
every flat param; the full state is summed over data parallel (zeros elsewhere).

:class:`MegatronState` is the half of
:class:`~actors.backends.megatron_backend.MegatronBackend` that does this; the
state it reads is the backend's (set at ``setup``).
"""

from __future__ import annotations

import copy
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import transformers

from actors.backends import megatron_convert as mc
from actors.backends.base import Loss, check_checkpoint, read_trainer_version, write_trainer_state
from actors.backends.mixed_precision import MainParamsOptimizer
from contracts.weights import ShardSpec

__all__ = ["ADAM_EPS", "DTYPES", "MegatronState"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the torch backend uses


class MegatronState:
    """Weights and optimizer state in HF names, for a :class:`MegatronBackend`."""

    model: torch.nn.Module  # the Megatron GPTModel (unwrapped)
    ddp: torch.nn.Module | None  # its DistributedDataParallel wrapper (distributed optimizer only)
    optimizer: Any
    shape: mc.GptShape
    hf_config: transformers.PretrainedConfig
    model_dir: pathlib.Path
    loss: Loss
    device: torch.device
    dtype: torch.dtype
    mixed: bool
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    world_size: int
    rank: int
    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup
    _version: int
    _adam_steps: int
    _specs: dict[str, ShardSpec]

    _require_setup: Callable[[], None]  # the backend's
    _copy_in: Callable[[dict[str, torch.Tensor]], None]  # writes full Megatron tensors (this rank's TP part)

    # -- weights under HF names --------------------------------------------------------

    def _local_hf(self) -> dict[str, tuple[torch.Tensor, ShardSpec]]:
        """This rank's part of every HF tensor (live views or split copies) and its spec.
        Data-parallel rank 0 of each TP group publishes the TP slices; a replicated tensor
        (norm) only TP rank 0 of it; every other rank an empty slice."""
        live = {n: p.detach() for n, p in self.model.named_parameters()}
        slices = mc.megatron_to_hf_local(live, self.shape, tp_rank=self.tp_rank, tp_size=self.tp_size)
        full_shapes = mc.hf_full_shapes(self.shape)
        out = {}
        for name, part in slices.items():
            full = full_shapes[name]
            t, dim, offset = part.tensor, part.dim, part.offset
            if self.dp_rank != 0 or (mc.hf_is_replicated(name) and self.tp_rank != 0):
                t, offset = t.narrow(dim, 0, 0), 0
            out[name] = (t, ShardSpec(full_shape=full, dim=dim, offset=offset, length=t.shape[dim]))
        return out

    def named_weights(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor]:
        """Every weight under its HF ``state_dict`` name (``lm_head.weight`` too when tied,
        the embedding's tensor). Fused tensors come apart: q/k/v are copies, gate/up and
        the rest views of the live params (do not modify them); ``dtype`` converts.
        More than one rank: this rank's slices, which :meth:`shard_specs` describes."""
        self._require_setup()
        if isinstance(dtype, str):
            dtype = DTYPES.get(dtype) or getattr(torch, dtype)
        out: dict[str, torch.Tensor] = {}
        converted: dict[int, torch.Tensor] = {}  # a tied name stays the same tensor
        for name, (t, _) in self._local_hf().items():
            if dtype is not None and t.dtype != dtype:
                t = converted.setdefault(id(t), t.to(dtype))
            out[name] = t
        return out

    def shard_specs(self) -> dict[str, ShardSpec] | None:
        """More than one rank: which slice of each full HF tensor :meth:`named_weights`
        holds here (possibly empty); ``None`` in one process."""
        return dict(self._specs) if self.world_size > 1 else None

    # -- checkpoints -------------------------------------------------------------------

    def _param_names_hf(self) -> list[str]:
        """The HF model's ``named_parameters()`` order (tied lm_head once, under the embedding)."""
        return [n for n in mc.hf_full_shapes(self.shape) if not (self.shape.tied and n == "lm_head.weight")]

    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full Megatron tensor from every TP rank's ``local`` (every TP rank calls it)."""
        if self.tp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return mc.tp_unshard(name, parts, self.shape)

    def save(self, directory: str | pathlib.Path) -> None:
        """Write an HF-loadable checkpoint (``config.json`` + ``model.safetensors``), the
        optimizer state (``optimizer.pt``, the torch backend's format) and
        ``trainer_state.json`` into ``directory``. Every rank calls it; rank 0 writes."""
        self._require_setup()
        path = pathlib.Path(directory)
        full = {n: self._full(n, p.detach()).cpu() for n, p in self.model.named_parameters()}
        weights = mc.megatron_to_hf(full, self.shape, include_tied=False)
        states = self._optimizer_states_hf()
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            config = copy.deepcopy(self.hf_config)
            config.dtype = self.dtype  # the weights' dtype, as the torch backend's save_pretrained writes it
            config.save_pretrained(path)
            if (self.model_dir / "generation_config.json").is_file():
                shutil.copyfile(self.model_dir / "generation_config.json", path / "generation_config.json")
            safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
                                        metadata={"format": "pt"})
            # the hyperparameters as this torch's AdamW writes them (every key its load expects)
            groups = torch.optim.AdamW([torch.zeros(1)], lr=self.lr, betas=self.betas, eps=ADAM_EPS,
                                       weight_decay=self.weight_decay).state_dict()["param_groups"]
            torch.save(mc.optimizer_state_to_torch(states, self._param_names_hf(), groups, mixed=self.mixed),
                       path / "optimizer.pt")
            write_trainer_state(path, self._version, self.loss)
        if self.world_size > 1:
            dist.barrier()  # nobody reads the checkpoint before rank 0 has written it

    def load(self, directory: str | pathlib.Path) -> None:
        """Restore what :meth:`save` (or the torch backend's ``save``) wrote."""
        self._require_setup()
        path = pathlib.Path(directory)
        check_checkpoint(path)
        hf = safetensors.torch.load_file(str(path / "model.safetensors"))
        expected = set(self._param_names_hf())
        if set(hf) != expected:
            raise ValueError(f"checkpoint {str(path)!r} does not match the model: missing {sorted(expected - set(hf))}, "
                             f"unexpected {sorted(set(hf) - expected)}")
        saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        try:
            states = mc.optimizer_state_from_torch(saved, self._param_names_hf(), mixed=self.mixed)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"checkpoint {str(path)!r}: {e}") from None
        has_moments = any("exp_avg" in st for st in states.values())
        if has_moments:
            self._ensure_optimizer_state()  # before the weights: a dummy step may move them
        self._copy_in(mc.hf_to_megatron({k: v.to(self.dtype) for k, v in hf.items()}, self.shape))
        self._load_optimizer_states(states, hf, has_moments)
        self._version = read_trainer_version(path)

    # Optimizer state, keyed by HF name as the torch backend's optimizer.pt holds it:
    # {name: {"exp_avg", "exp_avg_sq", "step", and "param" (fp32 main param) when mixed}}.

    def _optimizer_states_hf(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every rank calls it; full tensors (host) on every rank."""
        keys = (["param"] if self.mixed else []) + (["exp_avg", "exp_avg_sq"] if self._adam_steps else [])
        per_key: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}  # key -> megatron name -> full
        for name, p in self.model.named_parameters():
            for key, flat in self._param_state_flat(p, keys).items():
                per_key[key][name] = self._full(name, flat.view(p.shape)).cpu()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensors in per_key.items():
            for hf_name, t in mc.megatron_to_hf(tensors, self.shape, include_tied=False).items():
                out.setdefault(hf_name, {})[key] = t.contiguous()
        if self._adam_steps:
            for st in out.values():
                st["step"] = torch.tensor(float(self._adam_steps))
        return out

    def _param_state_flat(self, p: torch.Tensor, keys: list[str]) -> dict[str, torch.Tensor]:
        """``keys`` of ``{"param": fp32 main param, "exp_avg", "exp_avg_sq"}`` of model
        param ``p``, flat and whole (on every data-parallel rank: every one calls it)."""
        if self.ddp is None:
            if isinstance(self.optimizer, MainParamsOptimizer):
                main = self.optimizer.main[[id(q) for q in self.optimizer.params].index(id(p))]
                st = self.optimizer.optimizer.state[main]
            else:
                main, st = p, self.optimizer.state[p]
            return {k: (main.detach() if k == "param" else st[k]).float().reshape(-1) for k in keys}
        found = self._dist_opt_shard(p)
        out: dict[str, torch.Tensor] = {}
        for key in keys:
            full = torch.zeros(p.numel(), dtype=torch.float32, device=self.device)
            if found is not None:
                tensors, start, end = found
                full[start:end] = tensors[key].detach().reshape(-1).float()
            if self.dp_size > 1:  # each DP rank holds a disjoint range (zeros elsewhere): the sum is the whole
                dist.all_reduce(full, group=self.dp_group)
            out[key] = full
        return out

    def _dist_opt_shard(self, p: torch.Tensor) -> tuple[dict[str, torch.Tensor], int, int] | None:
        """The distributed optimizer's state of ``p``'s range on this DP rank and the
        range ``[start, end)`` of the flat param, or None when this rank holds none of it."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if p in getattr(opt, "model_param_group_index_map", {}):
                tensors = opt._get_main_param_and_optimizer_states(p)
                rng = opt._get_model_param_range_map(p)["param"]
                return tensors, rng.start, rng.end
        return None

    def _ensure_optimizer_state(self) -> None:
        """Create Adam's state (zeros after a zero-grad step) where it does not exist yet,
        so a checkpoint's state can be copied into it."""
        if self.ddp is None:
            inner = self.optimizer.optimizer if isinstance(self.optimizer, MainParamsOptimizer) else self.optimizer
            for group in inner.param_groups:
                for q in group["params"]:
                    if not inner.state.get(q):
                        inner.state[q] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(q),
                                          "exp_avg_sq": torch.zeros_like(q)}
            return
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if any(opt.optimizer.state.get(q) for g in opt.optimizer.param_groups for q in g["params"]):
                continue
            opt._init_optimizer_states_with_dummy_values()

    @torch.no_grad()
    def _load_optimizer_states(self, states: dict[str, dict[str, torch.Tensor]], hf: dict[str, torch.Tensor],
                               has_moments: bool) -> None:
        """Copy a checkpoint's per-HF-name optimizer state into this rank's optimizer: the
        main params (the checkpoint's when mixed, else the weights) and Adam's moments and
        step; a checkpoint without moments (saved before any step) resets them."""
        names = self._param_names_hf()
        steps = int(states[names[0]]["step"]) if has_moments else 0
        main_hf = {n: (states[n]["param"] if self.mixed else hf[n]).float() for n in names}
        per_key = {"param": mc.hf_to_megatron(main_hf, self.shape)}
        if has_moments:
            for key in ("exp_avg", "exp_avg_sq"):
                per_key[key] = mc.hf_to_megatron({n: states[n][key] for n in names}, self.shape)
        for name, p in self.model.named_parameters():
            local = {k: mc.tp_shard(name, v[name], self.shape, self.tp_rank, self.tp_size).reshape(-1)
                     for k, v in per_key.items()}
            self._set_param_state(p, local, steps)
        self._adam_steps = steps

    def _set_param_state(self, p: torch.Tensor, flat: dict[str, torch.Tensor], steps: int) -> None:
        """``flat``: ``param`` and, unless resetting, ``exp_avg`` / ``exp_avg_sq`` of model
        param ``p`` (flat, whole); ``steps``: Adam's step count."""
        if self.ddp is None:
            if isinstance(self.optimizer, MainParamsOptimizer):
                main = self.optimizer.main[[id(q) for q in self.optimizer.params].index(id(p))]
                inner = self.optimizer.optimizer
            else:
                main, inner = p, self.optimizer
            main.copy_(flat["param"].view(main.shape))
            if main is not p:
                p.copy_(main)  # the model params are the main params rounded
            if "exp_avg" not in flat:
                inner.state.pop(main, None)  # fresh, as torch's load_state_dict of an empty state
                return
            st = inner.state[main]
            st["exp_avg"].copy_(flat["exp_avg"].view(main.shape))
            st["exp_avg_sq"].copy_(flat["exp_avg_sq"].view(main.shape))
            st["step"] = torch.tensor(float(steps))
            return
        found = self._dist_opt_shard(p)
        if found is None:
            return
        tensors, start, end = found
        src = {k: v[start:end].to(self.device) for k, v in flat.items()}
        for key, dst in tensors.items():
            if key == "step" and isinstance(dst, torch.Tensor):
                src[key] = torch.full_like(dst, float(steps))
            elif key not in src:  # moments to reset (a checkpoint saved before any step)
                src[key] = torch.zeros_like(dst)
        opt = next(o for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                   if p in o.model_param_group_index_map)
        opt._set_main_param_and_optimizer_states(p, src)
        for group in opt.optimizer.param_groups:  # Adam implementations that count steps per group
            if "step" in group:
                group["step"] = steps
