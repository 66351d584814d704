"""Model weights held as tensors keyed by Hugging Face parameter names.

All parameters live in ONE flat buffer; ``params[name]`` is a view into it.
q/k/v and gate/up sit next to each other, so the fused projections the
forward uses (``qkv_w``, ``gate_up_w``) are views too: an update written in
place into ``params[name]`` (by name, as the trainer sends it) is seen by the
fused matmuls and by captured CUDA graphs without any copy. Offloading
(``sleep(2)``) moves the one buffer and rebuilds the views.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from actors.engines.model import ModelConfig
from actors.engines.mtp_model import fresh_modules, init_modules, module_views, module_weight_names, mtp_shapes
from contracts.weights import WeightUpdate

LM_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


@dataclass
class FullWeights:
    """A full set of HF-named weights at ``version`` — the update type the
    torch engine accepts besides ``sync``'s manifests. ``lm_head.weight`` is
    ignored for tied-embedding models."""

    version: int
    tensors: dict[str, torch.Tensor]


def with_tied_head(named: dict[str, object], tied: bool) -> dict[str, object]:
    """``named`` (Hugging Face names), with a tied ``lm_head.weight`` listed too,
    as the embedding, like ``state_dict()`` lists it."""
    out = dict(named)
    if tied:
        out[LM_HEAD] = out[EMBED]
    return out


def update_targets(named: dict[str, object], update: WeightUpdate, *, tied: bool) -> dict[str, object]:
    """The HF-named tensors ``sync.apply`` writes ``update`` into: ``named``. A tied
    model holds no ``lm_head.weight``; if an update names it anyway (a sender that
    did not tie them), it goes to the embedding, or, when the embedding comes in the
    same update, to a throw-away copy (writing one storage twice would fail a
    delta's base checksum)."""
    targets = dict(named)
    if tied:
        names = {e.name for e in update.manifest.entries}
        if LM_HEAD in names:
            embed = named[EMBED]
            targets[LM_HEAD] = embed.clone() if EMBED in names else embed
    return targets


class WeightStore:
    """HF-named views over one flat buffer, plus fused views for the forward.

    ``mtp_layers`` = K > 0: the buffer holds the K MTP modules' ``mtp.{k}.*`` weights
    too (``actors/engines/mtp_model.py``), written by name like every other weight;
    K = 0: ``mtp.*`` weights of a checkpoint or an update are skipped."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, mtp_layers: int = 0):
        self.cfg = cfg
        self.dtype = dtype
        self.mtp_layers = mtp_layers
        self.shapes = {**cfg.param_shapes(), **mtp_shapes(cfg, mtp_layers)}
        total = sum(_numel(s) for s in self.shapes.values())
        self.buffer: torch.Tensor | None = torch.empty(total, device=device, dtype=dtype)
        self._bind()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def _bind(self) -> None:
        """(Re)build the HF-named and fused views over ``self.buffer``."""
        self.params: dict[str, torch.Tensor] = {}
        offset = 0
        spans: dict[str, tuple[int, int]] = {}
        for name, shape in self.shapes.items():
            n = _numel(shape)
            self.params[name] = self.buffer[offset : offset + n].view(shape)
            spans[name] = (offset, n)
            offset += n
        cfg, p = self.cfg, self.params

        def fused(names: list[str], cols: int | None) -> torch.Tensor:
            start = spans[names[0]][0]
            n = sum(spans[x][1] for x in names)
            assert spans[names[-1]][0] + spans[names[-1]][1] == start + n, names
            flat = self.buffer[start : start + n]
            return flat.view(-1, cols) if cols else flat

        def layer(pre: str) -> SimpleNamespace:
            a, m = pre + "self_attn.", pre + "mlp."
            return SimpleNamespace(
                input_norm=p[pre + "input_layernorm.weight"],
                post_norm=p[pre + "post_attention_layernorm.weight"],
                qkv_w=fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], cfg.hidden_size),
                qkv_b=fused([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], None) if cfg.attention_bias else None,
                q_norm=p.get(a + "q_norm.weight"),
                k_norm=p.get(a + "k_norm.weight"),
                o_w=p[a + "o_proj.weight"],
                gate_up_w=fused([m + "gate_proj.weight", m + "up_proj.weight"], cfg.hidden_size),
                down_w=p[m + "down_proj.weight"],
            )

        self.layers = [layer(f"model.layers.{i}.") for i in range(cfg.num_layers)]
        self.mtp = module_views(p, layer, self.mtp_layers)
        self.embed = p[EMBED]
        self.final_norm = p["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else p[LM_HEAD]

    @torch.no_grad()
    def load_dir(self, model_path: str | Path) -> None:
        """Read every ``*.safetensors`` file of ``model_path`` into the views."""
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"model_path={str(model_path)!r} has no *.safetensors files")
        names: list[str] = []
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                names += [n for n in sf.keys() if not self._skip(n)]
        fresh = fresh_modules(names, self.mtp_layers, f"model_path={str(model_path)!r}")
        seen = module_weight_names(self.shapes, fresh)  # initialised below, once the model's are in
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if self._skip(name):
                        continue
                    self._check(name, tuple(sf.get_slice(name).get_shape()))
                    self.params[name].copy_(sf.get_tensor(name))
                    seen.add(name)
        missing = sorted(set(self.shapes) - seen)
        if missing:
            raise ValueError(f"model_path={str(model_path)!r} lacks weights: {missing[:5]}")
        init_modules(self.params, self.cfg, fresh)

    @torch.no_grad()
    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a full HF-named state in place; checks everything before writing."""
        names = [n for n in tensors if not self._skip(n)]
        fresh = fresh_modules(names, self.mtp_layers, "the full weight update")  # none: from the new weights
        for n in names:
            self._check(n, tuple(tensors[n].shape))
        missing = sorted(set(self.shapes) - set(names) - module_weight_names(self.shapes, fresh))
        if missing:
            raise ValueError(f"full weight update lacks weights: {missing[:5]}")
        for n in names:
            self.params[n].copy_(tensors[n])
        init_modules(self.params, self.cfg, fresh)

    def _skip(self, name: str) -> bool:
        return (self.cfg.tie_word_embeddings and name == LM_HEAD) or (self.mtp_layers == 0 and name.startswith("mtp."))

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self.shapes:
            raise ValueError(f"unknown weight {name!r} for a {self.cfg.model_type} model")
        if shape != self.shapes[name]:
            raise ValueError(f"weight {name!r} has shape {list(shape)}, expected {list(self.shapes[name])}")

    def check_update(self, update: object) -> None:
        """Refuse ``update`` before it is written, when the store cannot take it (here: never)."""

    def refit(self, update: object) -> None:
        """Bring what the forward reads besides these views up to date after ``update`` was written
        (here: nothing; :class:`~actors.engines.fp8_store.Fp8WeightStore` re-quantizes)."""

    def statistics(self) -> dict[str, object]:
        """The store's own counters for the engine's ``statistics()`` (here: none)."""
        return {}

    def to(self, device: torch.device) -> None:
        """Move the buffer (offload / restore) and rebind the views."""
        if self.buffer.device == torch.device(device):
            return
        new = torch.empty_like(self.buffer, device=device, pin_memory=False)
        new.copy_(self.buffer)
        self.buffer = new
        self._bind()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
