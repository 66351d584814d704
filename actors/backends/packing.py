"""Packed sequences for the torch trainer backend: a micro-batch as one row, no padding.

    samples ─► packed_batch: input_ids / position_ids [1, N] (N = sum of prompt + response
               lengths; positions restart at 0 per sequence), cu_seqlens [S + 1] (int32),
               the positions whose hidden state predicts a response token [T], those tokens [T]
               and where each lands in the padded [B, T_max] of the loss; built on the host
               and moved in one non-blocking copy (batching.to_device)
            ─► the model with attn_implementation=PACKED_ATTENTION: attention never
               crosses a sequence boundary (cu_seqlens), RoPE sees each sequence from 0
            ─► hidden [1, N, H] ─► the predicting positions' [T, H]
            ─► the LM head in chunks (the torch backend's _head_gives_logprobs)

Attention (:func:`packed_attention`, registered with Hugging Face's
``AttentionInterface``): ``torch.nn.attention.varlen.varlen_attn`` (the flash
kernel over cumulative lengths) on CUDA in bf16 / fp16 where this torch has it;
elsewhere (CPU, fp32, older torch) one causal SDPA per sequence, which is exact
and what the CPU tests compare with the padded path. Nothing here reads a device
tensor back: the sequence bounds travel to the attention as host ints too.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from actors.backends.batching import to_device
from contracts.sample import Sample

try:  # torch >= 2.9; its signature changed across releases (read below)
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    _VARLEN_PARAMS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:  # pragma: no cover - depends on the torch build
    _varlen_attn, _VARLEN_PARAMS = None, frozenset()

__all__ = ["PACKED_ATTENTION", "PackedBatch", "packed_attention", "packed_batch", "packing_unsupported",
           "varlen_available"]

#: The attention implementation name a packed model runs with.
PACKED_ATTENTION = "asyncrl_packed"
#: Model families whose body needs nothing but per-sequence causal attention and RoPE
#: positions to run packed (checked with :func:`packing_unsupported`).
_PACKED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
#: Config keys that change the logits or the attention beyond what packing reproduces.
_UNSUPPORTED_KEYS = ("attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One micro-batch packed into a single row (every tensor on the model's device)."""

    input_ids: torch.Tensor  # [1, N] int64
    position_ids: torch.Tensor  # [1, N] int64, 0.. per sequence
    cu_seqlens: torch.Tensor  # [S + 1] int32, sequence boundaries in N
    seq_bounds: tuple[int, ...]  # cu_seqlens on the host: the per-sequence attention slices by them
    max_len: int  # the longest sequence
    pred_positions: torch.Tensor  # [T] int64: the hidden state at N-index p predicts token p + 1
    targets: torch.Tensor  # [T] int64: the response tokens, sample by sample
    resp_index: torch.Tensor  # [T] int64: where each target sits in mask.view(-1) (row-major)
    mask: torch.Tensor  # [B, T_max] float32: 1 on real response tokens (row-major = the order of targets)

    def attention_kwargs(self) -> dict:
        """What the model's forward passes down to :func:`packed_attention` (Hugging Face's names,
        and ``packed_seq_bounds``, which Hugging Face passes on untouched)."""
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_len, "max_length_k": self.max_len, "packed_seq_bounds": self.seq_bounds}

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-target ``values`` ``[T, ...]`` laid out as the loss reads them: ``[B, T_max, ...]``,
        zero on padding. Differentiable; an index copy (a masked scatter's backward would read
        the mask's count back from the device)."""
        flat = values.new_zeros(self.mask.numel(), *values.shape[1:]).index_copy(0, self.resp_index, values)
        return flat.view(*self.mask.shape, *values.shape[1:])


def varlen_available() -> bool:
    """Whether this torch has the varlen flash attention the packed path runs on CUDA."""
    return _varlen_attn is not None


def packed_batch(samples: list[Sample], device: torch.device, pad_to: tuple[int, int] | None = None,
                 pad_piece: int = 128) -> PackedBatch:
    """Concatenate each sample's prompt and response into one row (see :class:`PackedBatch`).
    ``pad_to=(tokens, sequences)``: the row padded to ``tokens`` with sequences of pad id 0 of
    at most ``pad_piece`` tokens each, then ``cu_seqlens`` to ``sequences`` with empty ones
    (a fixed shape, for ``trainer.cuda_graphs``); the responses' fields are unchanged."""
    if not samples:
        raise ValueError("empty batch")
    lengths = np.asarray([len(s.prompt_ids) + len(s.response_ids) for s in samples], dtype=np.int64)
    num_resp = np.asarray([len(s.response_ids) for s in samples], dtype=np.int64)
    seq_lengths = lengths
    if pad_to is not None:
        pad = pad_to[0] - int(lengths.sum())
        pieces = [pad_piece] * (pad // pad_piece) + ([pad % pad_piece] if pad % pad_piece else [])
        empty = pad_to[1] - len(samples) - len(pieces)
        if pad < 0 or empty < 0:
            raise ValueError(f"{len(samples)} samples of {int(lengths.sum())} tokens do not fit pad_to={pad_to}")
        seq_lengths = np.concatenate([lengths, np.asarray(pieces + [0] * empty, dtype=np.int64)])
    starts = np.concatenate([[0], np.cumsum(seq_lengths)])
    ids = np.zeros(int(starts[-1]), dtype=np.int64)
    pred = np.empty(int(num_resp.sum()), dtype=np.int64)
    targets = np.empty_like(pred)
    t = 0
    for i, s in enumerate(samples):
        if len(s.prompt_ids) == 0:
            raise ValueError(f"sample {s.uid!r} has an empty prompt")
        o, p, n = int(starts[i]), len(s.prompt_ids), len(s.response_ids)
        ids[o : o + p] = s.prompt_ids
        ids[o + p : o + p + n] = s.response_ids
        pred[t : t + n] = np.arange(o + p - 1, o + p - 1 + n)  # as padded_batch: P - 1 + j, shifted by o
        targets[t : t + n] = s.response_ids
        t += n
    positions = np.arange(len(ids), dtype=np.int64) - np.repeat(starts[:-1], seq_lengths)
    width = max(int(num_resp.max()), 1)
    mask = (np.arange(width)[None, :] < num_resp[:, None]).astype(np.float32)
    resp_index = np.flatnonzero(mask)  # row-major, as targets
    ids, positions, cu_seqlens, pred, targets, resp_index, mask = to_device(
        [ids, positions, starts.astype(np.int32), pred, targets, resp_index, mask], device)
    return PackedBatch(input_ids=ids[None], position_ids=positions[None], cu_seqlens=cu_seqlens,
                       seq_bounds=tuple(starts.tolist()), max_len=int(seq_lengths.max()), pred_positions=pred,
                       targets=targets, resp_index=resp_index, mask=mask)


def packing_unsupported(model: transformers.PreTrainedModel) -> str | None:
    """Why ``model`` cannot run packed (one line), or None when it can."""
    cfg = model.config
    if cfg.model_type not in _PACKED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {', '.join(_PACKED_MODEL_TYPES)}"
    if any(getattr(cfg, k, None) not in (None, 1.0) for k in _UNSUPPORTED_KEYS):
        return f"{cfg.model_type} with {[k for k in _UNSUPPORTED_KEYS if getattr(cfg, k, None) not in (None, 1.0)]}"
    sliding = getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True)
    if sliding or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return f"{cfg.model_type} with sliding-window attention layers"
    if not hasattr(model, "set_attn_implementation"):
        return f"transformers {transformers.__version__} cannot switch a loaded model's attention"
    if not getattr(model, "_can_set_attn_implementation", lambda: True)():
        return f"{type(model).__name__} does not take Hugging Face's attention interface"
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"{type(model).__name__}'s output head is a {type(head).__name__}, not a Linear"
    return None


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, packed_seq_bounds: tuple[int, ...] | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence. ``query`` ``[1, H, N, D]``,
    ``key`` / ``value`` ``[1, H_kv, N, D]``; returns ``[1, N, H, D]`` (as Hugging Face's
    eager attention does) and no weights. ``packed_seq_bounds``: ``cu_seq_lens_q`` on the
    host, which the per-sequence path slices by (else it reads them back, once per layer)."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise RuntimeError(f"attn_implementation={PACKED_ATTENTION!r} needs cu_seq_lens_q and max_length_q "
                           f"(a packed batch); this model was called without them")
    assert query.shape[0] == 1 and attention_mask is None and dropout == 0.0 and sliding_window is None
    head_dim = query.shape[-1]
    scaling = head_dim**-0.5 if scaling is None else scaling
    if _varlen_attn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        return _varlen_packed(query, key, value, cu_seq_lens_q, int(max_length_q), scaling), None
    bounds = cu_seq_lens_q.tolist() if packed_seq_bounds is None else packed_seq_bounds
    sizes = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    gqa = query.shape[1] != key.shape[1]
    # split, not one slice per sequence: its backward is one cat, where every slice's
    # would write the whole [1, H, N, D] gradient, zeros but for its own rows
    parts = [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
             for q, k, v in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2))]
    return torch.cat(parts, dim=2).transpose(1, 2), None


def _varlen_packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                   max_len: int, scaling: float) -> torch.Tensor:
    """:func:`packed_attention` through :func:`_varlen`: ``[1, H, N, D]`` in, ``[1, N, H, D]`` out.
    ``squeeze(0)``, not ``[0]``: the same view forward, but a select's backward writes each
    gradient into a zeroed ``[1, H, N, D]`` copy (a fill and a strided copy for q, k and v in
    every layer), where a squeeze's hands the kernel's ``[N, H, D]`` gradient on as a view,
    the layout the projections' backward reads."""
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))
    return _varlen(q, k, v, cu_seqlens, max_len, scaling)[None]  # [1, N, H, D]


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
            scaling: float) -> torch.Tensor:
    """``varlen_attn`` over ``[N, H, D]`` tensors, causal, whichever of its signatures this torch has
    (2.9/2.10: ``is_causal``, no GQA, no scale; later: ``window_size``, ``enable_gqa``, ``scale``)."""
    kw: dict = {}
    if "window_size" in _VARLEN_PARAMS:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kw["enable_gqa"] = True
        else:  # query head h reads key/value head h // group, as HF's repeat_kv
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if "scale" in _VARLEN_PARAMS:
        kw["scale"] = scaling
    elif abs(scaling - q.shape[-1] ** -0.5) > 1e-12:  # the kernel's default scale is 1/sqrt(D)
        q = q * (scaling * q.shape[-1] ** 0.5)
    return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kw)


transformers.AttentionInterface.register(PACKED_ATTENTION, packed_attention)
