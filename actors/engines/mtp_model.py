"""The MTP modules of ``docs/mtp.md`` on the engine's side: their weights (names,
shapes, the deterministic initialisation), their forward, their KV cache, and the
full model's multi-token forward that verifies their drafts.

    prefill_hidden(tokens [B, T], slots [B])          -> H0 [B, T, h]      (writes KV[:, slots, :, :T])
    extend(tokens [B, T], positions [B, T], valid)    -> H0, logits [B, T, V]  (writes KV at positions)
    module_forward(k, tokens, hidden [B, T, h], ...)  -> H_{k+1} [B, T, h]  (writes module k's KV)

``H0`` is the main model's final hidden state after ``model.norm`` (what ``lm_head``
reads). Module ``k`` at position ``i`` reads ``H_k[i]`` and the embedding of token
``i + k + 1`` and predicts token ``i + k + 2``; its attention runs over its own KV
cache, one decoder layer's worth, kept as extra layers of the engine's cache
(:class:`DraftKVCache`), so that moving, freeing and allocating slots (compaction,
``sleep``, ``wake_up``) treat the draft state exactly like the main one. The layer
math is the main model's own (:class:`~actors.engines.model.Model`'s halves).
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from actors.engines.kv_cache import KVCache
from actors.engines.model import Model, ModelConfig

__all__ = ["DraftKVCache", "extend", "fresh_modules", "init_modules", "module_forward", "module_logits",
           "module_views", "mtp_shapes", "prefill_hidden"]

_MTP_NAME = re.compile(r"mtp\.(\d+)\.")
_HEAD_PARTS = ("enorm", "hnorm", "eh_proj", "norm")  # besides the decoder layer, per module


def mtp_shapes(cfg: ModelConfig, num_modules: int) -> dict[str, tuple[int, ...]]:
    """HF-style name -> shape of the ``num_modules`` MTP modules (``mtp.{k}.*``), each
    module's decoder layer in the main layers' order (so q/k/v and gate/up fuse as views)."""
    first = "model.layers.0."
    layer = {n[len(first):]: s for n, s in cfg.param_shapes().items() if n.startswith(first)}
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for k in range(num_modules):
        p = f"mtp.{k}."
        shapes[p + "enorm.weight"] = (h,)
        shapes[p + "hnorm.weight"] = (h,)
        shapes[p + "eh_proj.weight"] = (h, 2 * h)
        shapes.update({p + "layer." + n: s for n, s in layer.items()})
        shapes[p + "norm.weight"] = (h,)
    return shapes


def module_index(name: str) -> int | None:
    """``k`` of a ``mtp.{k}.*`` name; None for any other weight."""
    m = _MTP_NAME.match(name)
    return int(m.group(1)) if m else None


def fresh_modules(names: list[str], num_modules: int, where: str) -> list[int]:
    """The modules (of ``num_modules``) that ``names`` carries no weight of: initialised
    by :func:`init_modules`. ``names`` with more modules than ``num_modules`` is an error
    naming both numbers (``where``: what carried them)."""
    present = {k for n in names if (k := module_index(n)) is not None}
    if present and max(present) >= num_modules:
        raise ValueError(f"{where} has {max(present) + 1} MTP modules (mtp.*), more than "
                         f"model.mtp_layers={num_modules}")
    return [k for k in range(num_modules) if k not in present]


def module_weight_names(shapes: dict[str, tuple[int, ...]], modules: list[int]) -> set[str]:
    return {n for n in shapes if module_index(n) in modules}


@torch.no_grad()
def init_modules(params: dict[str, torch.Tensor], cfg: ModelConfig, modules: list[int]) -> None:
    """The spec's initialisation, no RNG: the decoder layer a copy of the model's last,
    ``enorm`` / ``hnorm`` ones, ``norm`` a copy of ``model.norm``, ``eh_proj`` = [0 | I]
    (the module starts as the last layer applied again to the hidden state)."""
    last = f"model.layers.{cfg.num_layers - 1}."
    h = cfg.hidden_size
    for k in modules:
        p = f"mtp.{k}."
        for name, tensor in params.items():
            if name.startswith(p + "layer."):
                tensor.copy_(params[last + name[len(p + "layer."):]])
        params[p + "enorm.weight"].fill_(1.0)
        params[p + "hnorm.weight"].fill_(1.0)
        params[p + "norm.weight"].copy_(params["model.norm.weight"])
        eh = params[p + "eh_proj.weight"]
        eh.zero_()
        eh[:, h:].copy_(torch.eye(h, dtype=eh.dtype, device=eh.device))


def module_views(params: dict[str, torch.Tensor], layer_views, num_modules: int) -> list[SimpleNamespace]:
    """Per module: ``layer`` (the fused views ``layer_views(prefix)`` builds, like a main
    layer's), ``enorm``, ``hnorm``, ``eh_proj``, ``norm``."""
    return [SimpleNamespace(layer=layer_views(f"mtp.{k}.layer."),
                            **{part: params[f"mtp.{k}.{part}.weight"] for part in _HEAD_PARTS})
            for k in range(num_modules)]


class DraftKVCache(KVCache):
    """The engine's KV cache with the draft state beside it, slot for slot: layers
    ``num_layers .. num_layers + K - 1`` are the K modules' KV, and ``hidden``
    [slots, 2K, h] holds each running request's last 2K main hidden states ``H0``
    (positions ``p - 2K .. p - 1`` for a request whose newest token sits at ``p``),
    the inputs its next drafts recompute the modules' tail from."""

    def __init__(self, cfg: ModelConfig, num_modules: int, num_slots: int, max_len: int,
                 device: torch.device, dtype: torch.dtype):
        self.num_main_layers = cfg.num_layers
        self.num_modules = num_modules
        self.window = 2 * num_modules
        self.hidden_size = cfg.hidden_size
        self.hidden: torch.Tensor | None = None
        super().__init__(cfg.num_layers + num_modules, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim,
                         device, dtype)

    @property
    def nbytes(self) -> int:
        extra = self.num_slots * self.window * self.hidden_size * torch.empty((), dtype=self.dtype).element_size()
        return super().nbytes + extra

    def allocate(self) -> None:
        super().allocate()
        if self.hidden is None:
            self.hidden = torch.zeros(self.num_slots, self.window, self.hidden_size, device=self.device,
                                      dtype=self.dtype)

    def free(self) -> None:
        super().free()
        self.hidden = None

    def move(self, moves: list[tuple[int, int, int]]) -> None:
        super().move(moves)
        for src, dst, _ in moves:
            self.hidden[dst] = self.hidden[src]

    def module(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Module ``k``'s keys and values, [slots, Hkv, max_len, D] each."""
        return self.k[self.num_main_layers + k], self.v[self.num_main_layers + k]


# ---- forward -------------------------------------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _attend_prefix(model: Model, q, k, v, k_cache, v_cache, slots: torch.Tensor) -> torch.Tensor:
    """Prefill from position 0: keys and values of the chunk itself (as ``Model.prefill``)."""
    T = q.shape[1]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
    k_cache[slots, :, :T] = k
    v_cache[slots, :, :T] = v
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=model.scale,
                                       enable_gqa=model.cfg.num_heads != model.cfg.num_kv_heads)
    return a.transpose(1, 2).flatten(2)


class _CachePlan(NamedTuple):
    """What every layer of one forward over tokens at ``positions`` [B, T] (clamped into the
    cache) writes and reads, computed once (:func:`_plan`): ``rows`` [B, T] and ``source``
    [B, T, 1, 1], the token whose keys and values each entry writes; ``mask`` [B, 1, T, L], the
    cache positions each query sees."""

    rows: torch.Tensor
    source: torch.Tensor
    mask: torch.Tensor


def _plan(model: Model, positions: torch.Tensor, valid: torch.Tensor, cache_len: int) -> _CachePlan:
    """No boolean indexing, which would wait for the device: every entry is written, one that
    is not ``valid`` with the values of the valid one its clamped position falls on (the
    callers' invalid entries are those clamped to 0 or to the last position, which a valid
    entry of the same row holds), so the duplicate writes agree."""
    B, T = positions.shape
    same = (positions[:, :, None] == positions[:, None, :]) & valid[:, None, :]  # [B, T, T]
    source = same.to(torch.uint8).argmax(-1)[..., None, None]  # itself, for a valid entry
    mask = model.key_positions[:cache_len][None, None, :] <= positions[:, :, None]  # [B, T, L]
    return _CachePlan(torch.arange(B, device=positions.device)[:, None].expand(B, T), source, mask[:, None])


def _attend_cached(model: Model, q, k, v, k_cache, v_cache, positions: torch.Tensor,
                   plan: _CachePlan) -> torch.Tensor:
    """Rows ``0..B-1`` at ``positions`` [B, T]: write the valid entries' keys and values, then
    attend over the cache up to each query's own position (causal within the tokens and over
    what the cache holds before them)."""
    B = positions.shape[0]
    k_cache[plan.rows, :, positions] = k.gather(1, plan.source.expand_as(k))
    v_cache[plan.rows, :, positions] = v.gather(1, plan.source.expand_as(v))
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:B], v_cache[:B], attn_mask=plan.mask,
                                       scale=model.scale, enable_gqa=model.cfg.num_heads != model.cfg.num_kv_heads)
    return a.transpose(1, 2).flatten(2)


def _layer(model: Model, layer, h: torch.Tensor, cos, sin, attend) -> torch.Tensor:
    q, k, v = model._qkv(layer, h, cos, sin)
    return model._mlp_residual(layer, h, attend(q, k, v))


def prefill_hidden(model: Model, weights, kv: KVCache, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``Model.prefill``'s forward, keeping every position's ``H0`` (after the final norm)."""
    return _rms(model.prefill_layers(weights, kv, tokens, slots), weights.final_norm, model.cfg.rms_norm_eps)


@torch.inference_mode()
def extend(model: Model, weights, kv: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
           valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The full model over tokens [B, T] of rows (slots) ``0..B-1`` at ``positions`` [B, T]
    (entries not ``valid`` are computed but not written to the cache): (H0 [B, T, h],
    logits [B, T, V])."""
    positions = positions.clamp(0, kv.max_len - 1)
    cos, sin = model.cos[positions], model.sin[positions]
    plan = _plan(model, positions, valid, kv.k[0].shape[2])
    h = F.embedding(tokens, weights.embed)
    for n, layer in enumerate(weights.layers):
        h = _layer(model, layer, h, cos, sin,
                   lambda q, k, v, n=n: _attend_cached(model, q, k, v, kv.k[n], kv.v[n], positions, plan))
    h0 = _rms(h, weights.final_norm, model.cfg.rms_norm_eps)
    return h0, F.linear(h0, weights.lm_head)


@torch.inference_mode()
def module_forward(model: Model, weights, kv: DraftKVCache, k: int, tokens: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor | None, valid: torch.Tensor | None,
                   slots: torch.Tensor | None = None) -> torch.Tensor:
    """Module ``k`` over tokens [B, T] (token ``i + k + 1`` at column ``i``) and hidden
    [B, T, h] (``H_k``): ``H_{k+1}`` [B, T, h], its KV written. ``slots`` given: a prefill
    from position 0 into those slots (``positions`` / ``valid`` unused); else rows
    ``0..B-1`` at ``positions``, writing the ``valid`` entries."""
    m, eps = weights.mtp[k], model.cfg.rms_norm_eps
    x = F.linear(torch.cat([_rms(F.embedding(tokens, weights.embed), m.enorm, eps), _rms(hidden, m.hnorm, eps)],
                           dim=-1), m.eh_proj)
    k_cache, v_cache = kv.module(k)
    if slots is not None:
        T = tokens.shape[1]
        return _layer(model, m.layer, x, model.cos[:T], model.sin[:T],
                      lambda q, kk, v: _attend_prefix(model, q, kk, v, k_cache, v_cache, slots))
    assert positions is not None and valid is not None
    positions = positions.clamp(0, kv.max_len - 1)
    return _layer(model, m.layer, x, model.cos[positions], model.sin[positions],
                  lambda q, kk, v: _attend_cached(model, q, kk, v, k_cache, v_cache, positions,
                                                  _plan(model, positions, valid, k_cache.shape[2])))


def module_logits(model: Model, weights, k: int, hidden: torch.Tensor) -> torch.Tensor:
    """Module ``k``'s logits from its output ``H_{k+1}`` [..., h]: its norm, the shared head."""
    return F.linear(_rms(hidden, weights.mtp[k].norm, model.cfg.rms_norm_eps), weights.lm_head)
