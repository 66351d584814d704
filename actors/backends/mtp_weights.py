"""Multi-token prediction weights under their Hugging Face names, for every trainer backend.

    mtp.{k}.enorm.weight    [h]      RMSNorm on the embedding of the next token
    mtp.{k}.hnorm.weight    [h]      RMSNorm on the incoming hidden state
    mtp.{k}.eh_proj.weight  [h, 2h]  Linear, no bias, on cat([enorm(emb), hnorm(hidden)])
    mtp.{k}.layer.<name>             one decoder layer, named as model.layers.{i}.<name>
    mtp.{k}.norm.weight     [h]      RMSNorm before the shared head

(the module spec both the trainer and the engine follow; docs/mtp.md). A checkpoint
holds the modules it has under those names; Hugging Face's ``from_pretrained`` drops
them, so :func:`read_mtp_tensors` reads them from the safetensors files itself.
Modules it lacks start as :func:`init_mtp_tensors` gives them, with no randomness,
so a trainer and an engine that both start from such a checkpoint agree at version 0
without a push. Pure torch: the megatron backend maps these names to its own
(:mod:`actors.backends.megatron_convert`).
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Mapping

import safetensors
import torch

__all__ = ["MTP_PREFIX", "init_mtp_tensors", "mtp_module_count", "mtp_state", "read_mtp_tensors"]

#: The first part of every MTP weight's name.
MTP_PREFIX = "mtp."
_MODULE = re.compile(r"^mtp\.(\d+)\.")
_LAST_NORM = "model.norm.weight"


def mtp_module_count(names: object) -> int:
    """How many modules the names ``mtp.{k}.*`` among ``names`` describe (the highest k + 1; 0: none)."""
    found = [int(m.group(1)) for n in names if (m := _MODULE.match(str(n)))]
    return max(found) + 1 if found else 0


def read_mtp_tensors(model_dir: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """The ``mtp.*`` tensors of an HF checkpoint directory (host memory), reading no other
    tensor; empty for a checkpoint without them or without safetensors files."""
    d = pathlib.Path(model_dir)
    if (d / "model.safetensors").is_file():
        files = [d / "model.safetensors"]
    elif (d / "model.safetensors.index.json").is_file():
        weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        files = [d / f for f in sorted({f for n, f in weight_map.items() if n.startswith(MTP_PREFIX)})]
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safetensors.safe_open(str(f), framework="pt") as handle:
            out.update({n: handle.get_tensor(n) for n in handle.keys() if n.startswith(MTP_PREFIX)})
    return out


def init_mtp_tensors(hf: Mapping[str, torch.Tensor], k: int, num_layers: int) -> dict[str, torch.Tensor]:
    """Module ``k`` as the spec starts it, from the model's own HF tensors ``hf``: the layer a
    copy of the last decoder layer (``model.layers.{num_layers - 1}.*``), ``enorm`` and
    ``hnorm`` ones, ``norm`` a copy of ``model.norm.weight``, ``eh_proj`` ``[0 | I]`` (the
    last layer applied once more to the hidden state). New tensors, in ``hf``'s dtype."""
    if _LAST_NORM not in hf:
        raise ValueError(f"the model has no {_LAST_NORM} to initialise MTP module {k} from")
    last = f"model.layers.{num_layers - 1}."
    layer = {n[len(last):]: t for n, t in hf.items() if n.startswith(last)}
    if not layer:
        raise ValueError(f"the model has no {last}* tensors to initialise MTP module {k} from")
    norm = hf[_LAST_NORM]
    h = norm.shape[0]
    p = f"mtp.{k}."
    eh = torch.cat([torch.zeros(h, h, dtype=norm.dtype), torch.eye(h, dtype=norm.dtype)], dim=1)
    out = {p + "enorm.weight": torch.ones_like(norm, device="cpu"),
           p + "hnorm.weight": torch.ones_like(norm, device="cpu"),
           p + "eh_proj.weight": eh}
    out.update({p + "layer." + n: t.detach().cpu().clone() for n, t in layer.items()})
    out[p + "norm.weight"] = norm.detach().cpu().clone()
    return out


def mtp_state(saved: Mapping[str, torch.Tensor], hf: Mapping[str, torch.Tensor], num_mtp: int,
              num_layers: int, where: str) -> dict[str, torch.Tensor]:
    """Every ``mtp.{k}.*`` tensor of ``num_mtp`` modules: the checkpoint's (``saved``, its
    ``mtp.*`` tensors) where it has the module, else :func:`init_mtp_tensors` from ``hf``.
    ``ValueError`` (one line, naming ``where``) for a checkpoint with more modules than
    ``num_mtp``, or a module whose names or shapes are not those of this model's layer."""
    have = mtp_module_count(saved)
    if have > num_mtp:
        raise ValueError(f"{where} has {have} MTP modules (mtp.0..mtp.{have - 1}) and model.mtp_layers is "
                         f"{num_mtp}; set model.mtp_layers: {have} (or more)")
    out: dict[str, torch.Tensor] = {}
    for k in range(num_mtp):
        fresh = init_mtp_tensors(hf, k, num_layers)
        mine = {n: t for n, t in saved.items() if n.startswith(f"mtp.{k}.")}
        if not mine:
            out.update(fresh)
            continue
        missing, unexpected = sorted(set(fresh) - set(mine)), sorted(set(mine) - set(fresh))
        if missing or unexpected:
            raise ValueError(f"{where}: MTP module {k} does not match this model's layer: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        wrong = [n for n in fresh if tuple(mine[n].shape) != tuple(fresh[n].shape)]
        if wrong:
            raise ValueError(f"{where}: {wrong[0]} has shape {tuple(mine[wrong[0]].shape)}, this model's "
                             f"{tuple(fresh[wrong[0]].shape)}")
        out.update({n: mine[n] for n in fresh})
    return out
