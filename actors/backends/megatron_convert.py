"""Hugging Face <-> Megatron-core weight layouts for Llama / Qwen2 GPT models.

Pure torch: nothing here imports megatron, so every mapping runs (and is
tested) on a CPU. The Megatron side is ``GPTModel`` built with the local
layer spec (``get_gpt_layer_local_spec(normalization="RMSNorm")``)::

    HF (Qwen2ForCausalLM / LlamaForCausalLM)          Megatron GPTModel
    model.embed_tokens.weight          [V, H]         embedding.word_embeddings.weight   [Vp, H]
    layers.i.input_layernorm.weight    [H]            decoder.layers.i.input_layernorm.weight
    layers.i.self_attn.{q,k,v}_proj.weight / .bias    decoder.layers.i.self_attention.linear_qkv.weight / .bias
                                                        [ng * (nh/ng + 2) * d, H], per query group:
                                                        its nh/ng q heads, then its k head, then its v head
    layers.i.self_attn.o_proj.weight   [H, nh*d]      decoder.layers.i.self_attention.linear_proj.weight
    layers.i.post_attention_layernorm.weight          decoder.layers.i.pre_mlp_layernorm.weight
    layers.i.mlp.{gate,up}_proj.weight [F, H] each    decoder.layers.i.mlp.linear_fc1.weight [2F, H]: gate rows, then up
    layers.i.mlp.down_proj.weight      [H, F]         decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                  [H]            decoder.final_layernorm.weight
    lm_head.weight (untied only)       [V, H]         output_layer.weight                 [Vp, H]

Multi-token prediction modules (``GptShape.mtp_layers`` K; names of docs/mtp.md), megatron-core's
``MultiTokenPredictionBlock`` (``get_gpt_mtp_block_spec``, local spec)::

    mtp.k.enorm.weight / hnorm.weight  [H]            mtp.layers.k.enorm.weight / hnorm.weight
    mtp.k.eh_proj.weight               [H, 2H]        mtp.layers.k.eh_proj.weight (column parallel)
    mtp.k.layer.<as layers.i above>                   mtp.layers.k.transformer_layer.<as decoder.layers.i>
    mtp.k.norm.weight                  [H]            mtp.layers.k.final_layernorm.weight

The fused qkv layout is the one ``SelfAttention.get_query_key_value_tensors``
splits (megatron/core/transformer/attention.py: ``[sq, b, ng, (np/ng + 2) * hn]``
then ``split([np/ng * hn, hn, hn], dim=3)``); gate-then-up is the order the
local MLP's ``glu`` chunks ``linear_fc1``'s output in. HF query head ``h`` uses
key/value head ``h // (nh/ng)`` (``repeat_kv``), which is Megatron's grouping.

Tensor parallel (``tp`` ranks): qkv and fc1 are column-parallel (rank r holds
query groups ``[r*ng/tp, (r+1)*ng/tp)``, and the rows ``[r*F/tp, (r+1)*F/tp)``
of gate and of up, fused), ``linear_proj`` and ``linear_fc2`` row-parallel
(dim 1), the embedding and output layer vocab-parallel (dim 0, the vocabulary
padded with zero rows to ``Vp``, a multiple of ``tp``), norms replicated.
Every rank's part of every HF tensor is then one contiguous slice.

The same maps move optimizer state (Adam's moments and the fp32 main params
are elementwise, shaped like their params), so checkpoints of either trainer
backend carry their optimizer state to the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "GptShape", "HfSlice", "fuse_gate_up", "fuse_qkv", "hf_to_megatron", "megatron_names",
    "hf_full_shapes", "hf_is_replicated", "megatron_to_hf", "megatron_to_hf_local", "split_gate_up", "split_qkv",
    "tp_shard", "tp_unshard",
    "optimizer_state_from_torch", "optimizer_state_to_torch",
]

#: HF model types with the Llama block this map covers.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclasses.dataclass(frozen=True)
class GptShape:
    """What the layout maps need to know about a model (read from its HF config)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_query_groups: int  # HF num_key_value_heads
    head_dim: int
    vocab_size: int
    qkv_bias: bool
    tied: bool  # tie_word_embeddings: no output_layer / lm_head of its own
    rms_norm_eps: float
    rotary_base: float
    max_position_embeddings: int
    mtp_layers: int = 0  # model.mtp_layers: not in the HF config; the backend sets it
    #: the MTP module's decoder layer attribute: megatron-core 0.16's; 0.19 names it ``mtp_model_layer``
    #: (the backend reads which from the model it built)
    mtp_layer_attr: str = "transformer_layer"

    @classmethod
    def from_hf_config(cls, cfg: object) -> GptShape:
        """Read an HF ``PretrainedConfig`` (or any object with its attributes).
        Raises ``ValueError`` naming a model type or feature the map does not cover."""
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the megatron backend supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
                             f"this model is {model_type!r}")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"the megatron backend supports hidden_act 'silu' (SwiGLU), this model has {act!r}")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("the megatron backend does not support sliding-window attention (use_sliding_window)")
        if model_type == "llama":
            if getattr(cfg, "attention_bias", False):  # o_proj would have a bias too: not a Megatron GPT layout
                raise ValueError("the megatron backend does not support Llama with attention_bias=True")
            if getattr(cfg, "mlp_bias", False):
                raise ValueError("the megatron backend does not support Llama with mlp_bias=True")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"
        if rope_type not in ("default", None):
            raise ValueError(f"the megatron backend supports plain rotary embeddings, this model has rope_type {rope_type!r}")
        theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
        theta = theta if theta is not None else getattr(cfg, "rope_theta", 10000.0)
        num_heads = int(cfg.num_attention_heads)
        num_groups = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        if num_heads % num_groups:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_groups}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        return cls(num_layers=int(cfg.num_hidden_layers), hidden_size=int(cfg.hidden_size),
                   ffn_hidden_size=int(cfg.intermediate_size), num_heads=num_heads, num_query_groups=num_groups,
                   head_dim=int(head_dim), vocab_size=int(cfg.vocab_size), qkv_bias=model_type == "qwen2",
                   tied=bool(getattr(cfg, "tie_word_embeddings", False)), rms_norm_eps=float(cfg.rms_norm_eps),
                   rotary_base=float(theta), max_position_embeddings=int(cfg.max_position_embeddings))

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Rows of the Megatron embedding: the vocabulary rounded up to a multiple of ``tp``."""
        return -(-self.vocab_size // tp) * tp

    def check_tp(self, tp: int) -> None:
        """Raise ``ValueError`` when the model cannot be split over ``tp`` ranks."""
        for what, n in (("num_key_value_heads", self.num_query_groups), ("intermediate_size", self.ffn_hidden_size)):
            if n % tp:
                raise ValueError(f"tensor parallel size {tp} does not divide this model's {what}={n}")


# -- the fused tensors --------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF ``q [nh*d, ...]``, ``k``, ``v [ng*d, ...]`` (weights or biases) -> Megatron's
    ``linear_qkv`` ``[ng*(nh/ng + 2)*d, ...]``: for each query group, its q heads, its k head, its v head."""
    ng, rest = num_query_groups, tuple(q.shape[1:])
    parts = [t.reshape(ng, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, num_query_groups: int, num_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv` (also for a tensor-parallel rank's part: pass
    that rank's ``num_query_groups`` and ``num_heads``). Returns copies."""
    ng, rest = num_query_groups, tuple(fused.shape[1:])
    q_rows = num_heads // ng * head_dim
    groups = fused.reshape(ng, q_rows + 2 * head_dim, *rest)
    q, k, v = groups.split([q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj``, ``up_proj`` ``[F, H]`` -> ``linear_fc1`` ``[2F, H]`` (gate rows first)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up` (views)."""
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


# -- whole models -------------------------------------------------------------------

_LAYER = "decoder.layers.{i}."
_HF_LAYER = "model.layers.{i}."
_MTP = "mtp.layers.{k}."
_HF_MTP = "mtp.{k}."
#: The parts of an MTP module that are not its decoder layer: Megatron name -> HF name.
_MTP_PARTS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
              "final_layernorm.weight": "norm.weight"}


def _layer_prefixes(shape: GptShape) -> list[tuple[str, str]]:
    """(Megatron, HF) name prefix of every decoder layer: the model's, then each MTP module's."""
    return ([(_LAYER.format(i=i), _HF_LAYER.format(i=i)) for i in range(shape.num_layers)]
            + [(_MTP.format(k=k) + shape.mtp_layer_attr + ".", _HF_MTP.format(k=k) + "layer.")
               for k in range(shape.mtp_layers)])


def megatron_names(shape: GptShape) -> list[str]:
    """Every parameter name of the Megatron ``GPTModel`` (local spec), in model order."""
    names = ["embedding.word_embeddings.weight"]
    for p, _ in _layer_prefixes(shape):
        names += [p + "input_layernorm.weight", p + "self_attention.linear_proj.weight",
                  p + "self_attention.linear_qkv.weight"]
        if shape.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        names += [p + "pre_mlp_layernorm.weight", p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    names += [_MTP.format(k=k) + part for k in range(shape.mtp_layers) for part in _MTP_PARTS]
    if not shape.tied:
        names.append("output_layer.weight")
    return names


def _simple_pairs(shape: GptShape) -> dict[str, str]:
    """Megatron name -> HF name for the tensors that map one to one."""
    pairs = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
             "decoder.final_layernorm.weight": "model.norm.weight"}
    if not shape.tied:
        pairs["output_layer.weight"] = "lm_head.weight"
    for k in range(shape.mtp_layers):
        pairs.update({_MTP.format(k=k) + m: _HF_MTP.format(k=k) + h for m, h in _MTP_PARTS.items()})
    for p, h in _layer_prefixes(shape):
        pairs[p + "input_layernorm.weight"] = h + "input_layernorm.weight"
        pairs[p + "pre_mlp_layernorm.weight"] = h + "post_attention_layernorm.weight"
        pairs[p + "self_attention.linear_proj.weight"] = h + "self_attn.o_proj.weight"
        pairs[p + "mlp.linear_fc2.weight"] = h + "mlp.down_proj.weight"
    return pairs


def _hf_layer(name: str) -> str:
    """``decoder.layers.3.x`` -> ``model.layers.3.``; ``mtp.layers.0.transformer_layer.x`` -> ``mtp.0.layer.``"""
    if name.startswith("mtp."):
        return _HF_MTP.format(k=name.split(".")[2]) + "layer."
    return _HF_LAYER.format(i=name.split(".")[2])


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: GptShape) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors from HF ones (a tied ``lm_head.weight`` may be
    absent). Raises ``ValueError`` naming the HF tensors that are missing."""
    pairs = _simple_pairs(shape)
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def get(name: str) -> torch.Tensor | None:
        if name not in hf:
            missing.append(name)
            return None
        return hf[name]

    for name in megatron_names(shape):
        if name in pairs:
            t = get(pairs[name])
        elif name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            kind = name.rsplit(".", 1)[1]
            h = _hf_layer(name) + "self_attn."
            q, k, v = (get(f"{h}{x}_proj.{kind}") for x in "qkv")
            t = None if q is None or k is None or v is None else fuse_qkv(q, k, v, shape.num_query_groups)
        elif name.endswith("linear_fc1.weight"):
            h = _hf_layer(name) + "mlp."
            gate, up = get(h + "gate_proj.weight"), get(h + "up_proj.weight")
            t = None if gate is None or up is None else fuse_gate_up(gate, up)
        else:  # pragma: no cover - megatron_names and the pairs above cover every name
            raise AssertionError(name)
        if t is not None:
            out[name] = t
    if missing:
        raise ValueError(f"missing Hugging Face tensors: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return out


def megatron_to_hf(mc: Mapping[str, torch.Tensor], shape: GptShape, *,
                   include_tied: bool = True) -> dict[str, torch.Tensor]:
    """Full HF tensors from full Megatron ones, in HF ``state_dict`` names; a tied
    ``lm_head.weight`` is the embedding tensor itself (``include_tied=False``: left
    out, as a safetensors checkpoint stores it)."""
    return {hf_name: part.tensor for hf_name, part in megatron_to_hf_local(mc, shape, include_tied=include_tied).items()}


@dataclasses.dataclass(frozen=True)
class HfSlice:
    """The part of a full HF tensor one tensor-parallel rank holds:
    ``tensor`` is indices ``[offset, offset + tensor.shape[dim])`` along ``dim``."""

    tensor: torch.Tensor
    dim: int
    offset: int


def hf_full_shapes(shape: GptShape) -> dict[str, tuple[int, ...]]:
    """Every HF ``state_dict`` tensor's full shape (``lm_head.weight`` too when tied)."""
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    out = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = _HF_LAYER.format(i=i)
        for x, heads in (("q", shape.num_heads), ("k", shape.num_query_groups), ("v", shape.num_query_groups)):
            out[p + f"self_attn.{x}_proj.weight"] = (heads * d, h)
            if shape.qkv_bias:
                out[p + f"self_attn.{x}_proj.bias"] = (heads * d,)
        out[p + "self_attn.o_proj.weight"] = (h, shape.num_heads * d)
        out[p + "mlp.gate_proj.weight"] = (f, h)
        out[p + "mlp.up_proj.weight"] = (f, h)
        out[p + "mlp.down_proj.weight"] = (h, f)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (shape.vocab_size, h)
    for k in range(shape.mtp_layers):  # after lm_head: the torch backend's parameter order
        p, last = _HF_MTP.format(k=k), _HF_LAYER.format(i=shape.num_layers - 1)
        out.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h)})
        out.update({p + "layer." + n[len(last):]: v for n, v in list(out.items()) if n.startswith(last)})
        out[p + "norm.weight"] = (h,)
    return out


def megatron_to_hf_local(mc: Mapping[str, torch.Tensor], shape: GptShape, *, tp_rank: int = 0,
                         tp_size: int = 1, include_tied: bool = True) -> dict[str, HfSlice]:
    """The HF slices tensor-parallel rank ``tp_rank`` holds, from its local Megatron
    tensors (``tp_size=1``: the full tensors, every slice whole). Replicated tensors
    (norms) come whole on every rank; which rank publishes them is the caller's choice.
    Embedding / output rows past the real vocabulary (padding) are dropped."""
    pairs = _simple_pairs(shape)
    ng_local = shape.num_query_groups // tp_size
    nh_local = shape.num_heads // tp_size
    d, f_local = shape.head_dim, shape.ffn_hidden_size // tp_size
    out: dict[str, HfSlice] = {}
    for name in megatron_names(shape):
        t = mc[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            rows = shape.padded_vocab_size(tp_size) // tp_size
            start = min(tp_rank * rows, shape.vocab_size)
            real = min(rows, shape.vocab_size - start)
            out[pairs[name]] = HfSlice(t[:real], 0, start)
        elif name in pairs:
            dim = 1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0
            offset = tp_rank * t.shape[dim] if _tp_kind(name) != "replicated" else 0
            out[pairs[name]] = HfSlice(t, dim, offset)
        elif name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            kind = name.rsplit(".", 1)[1]
            h = _hf_layer(name) + "self_attn."
            q, k, v = split_qkv(t, ng_local, nh_local, d)
            out[f"{h}q_proj.{kind}"] = HfSlice(q, 0, tp_rank * nh_local * d)
            out[f"{h}k_proj.{kind}"] = HfSlice(k, 0, tp_rank * ng_local * d)
            out[f"{h}v_proj.{kind}"] = HfSlice(v, 0, tp_rank * ng_local * d)
        elif name.endswith("linear_fc1.weight"):
            h = _hf_layer(name) + "mlp."
            gate, up = split_gate_up(t)
            out[h + "gate_proj.weight"] = HfSlice(gate, 0, tp_rank * f_local)
            out[h + "up_proj.weight"] = HfSlice(up, 0, tp_rank * f_local)
        else:  # pragma: no cover
            raise AssertionError(name)
    if shape.tied and include_tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: out[k] for k in hf_full_shapes(shape) if k in out}  # HF state_dict order


# -- tensor parallel --------------------------------------------------------------


def _tp_kind(name: str) -> str:
    """How a Megatron parameter is split over tensor-parallel ranks."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "eh_proj.weight")):
        return "column"
    if name.endswith("linear_fc1.weight"):
        return "gate_up"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def tp_shard(name: str, full: torch.Tensor, shape: GptShape, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of the full Megatron tensor ``name`` (padded vocabulary
    rows are zeros). ``tp_size=1``: ``full`` itself."""
    kind = _tp_kind(name)
    if tp_size == 1 and kind != "vocab" or kind == "replicated":
        return full
    if kind == "vocab":
        pad = shape.padded_vocab_size(tp_size) - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if kind == "column":  # group-major: contiguous chunks are whole query groups
        return full.chunk(tp_size, dim=0)[tp_rank]
    if kind == "row":
        return full.chunk(tp_size, dim=1)[tp_rank]
    gate, up = split_gate_up(full)
    return fuse_gate_up(gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank])


def tp_unshard(name: str, parts: Sequence[torch.Tensor], shape: GptShape) -> torch.Tensor:
    """The full Megatron tensor ``name`` from every tensor-parallel rank's part, in rank
    order (inverse of :func:`tp_shard`; the vocabulary padding is dropped)."""
    kind = _tp_kind(name)
    if kind == "replicated":
        return parts[0]
    if kind == "vocab":
        return torch.cat(list(parts), dim=0)[: shape.vocab_size]
    if kind == "column":
        return torch.cat(list(parts), dim=0)
    if kind == "row":
        return torch.cat(list(parts), dim=1)
    gates, ups = zip(*(split_gate_up(p) for p in parts))
    return fuse_gate_up(torch.cat(gates), torch.cat(ups))


# -- optimizer state in the torch backend's format ----------------------------------
#
# The torch backend's ``optimizer.pt`` is ``torch.optim.AdamW.state_dict()`` over the HF
# model's ``parameters()`` (tied weights once), wrapped as ``{"optimizer": ...,
# "main_params": [fp32 tensor per parameter]}`` when the model dtype is lower than the
# main params' (``actors.backends.mixed_precision.MainParamsOptimizer``). Keyed here by HF
# name: ``{name: {"exp_avg", "exp_avg_sq", "step", and "param" (the main param) when mixed}}``.


def optimizer_state_from_torch(saved: Mapping[str, object], param_names: Sequence[str], *,
                               mixed: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Per HF parameter name, the Adam state (and main param when ``mixed``) of a torch
    backend ``optimizer.pt``; ``param_names``: the HF model's ``named_parameters()``
    names in order. A parameter that has not been stepped has no entry.
    Raises ``ValueError`` when the state is not of the expected kind or size."""
    if mixed != ("main_params" in saved):
        raise ValueError(f"its optimizer state is {'' if 'main_params' in saved else 'not '}a mixed-precision "
                         f"one (fp32 main params), this backend's is the other kind")
    inner = saved["optimizer"] if mixed else saved
    if not isinstance(inner, Mapping) or "state" not in inner or "param_groups" not in inner:
        raise ValueError("its optimizer state is not a torch optimizer's state_dict")
    num_params = sum(len(g["params"]) for g in inner["param_groups"])
    if num_params != len(param_names) or (mixed and len(saved["main_params"]) != len(param_names)):
        raise ValueError(f"its optimizer state has {num_params} parameters, the model {len(param_names)}")
    index = [i for g in inner["param_groups"] for i in g["params"]]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for pos, name in enumerate(param_names):
        st = dict(inner["state"].get(index[pos], {}))
        if mixed:
            st["param"] = saved["main_params"][pos]
        if st:
            out[name] = st
    return out


def optimizer_state_to_torch(states: Mapping[str, Mapping[str, torch.Tensor]], param_names: Sequence[str],
                             param_groups: list[dict[str, object]], *, mixed: bool) -> dict[str, object]:
    """Inverse of :func:`optimizer_state_from_torch`: the torch backend's ``optimizer.pt``.
    ``param_groups``: one AdamW ``state_dict()["param_groups"]`` entry's hyperparameters
    (its ``params`` are set here); ``states[name]["param"]`` is required when ``mixed``."""
    group = {**param_groups[0], "params": list(range(len(param_names)))}
    state = {}
    for i, name in enumerate(param_names):
        st = {k: v for k, v in states.get(name, {}).items() if k != "param"}
        if st:
            state[i] = st
    inner = {"state": state, "param_groups": [group]}
    if not mixed:
        return inner
    missing = [n for n in param_names if "param" not in states.get(n, {})]
    if missing:
        raise ValueError(f"no main params for {', '.join(missing[:4])}")
    return {"optimizer": inner, "main_params": [states[n]["param"] for n in param_names]}


def hf_is_replicated(hf_name: str) -> bool:
    """Whether every tensor-parallel rank holds the whole HF tensor (the RMSNorm weights)."""
    return hf_name.endswith("norm.weight")
