"""Regional ``torch.compile`` of the torch trainer backend's model (``trainer.compile``).

    model.model.layers[i] ─► layer.compile(dynamic=True): one graph a layer (RMSNorm, q/k/v, RoPE,
                             attention, o_proj, residual adds, RMSNorm, the SwiGLU MLP); every layer
                             runs the same code under the same guards, so one compilation serves all
    model.model.norm      ─► the same, for the final RMSNorm
    packed attention      ─► asyncrl::packed_attention, a custom op: opaque to dynamo, so no graph
                             break and no guard on a batch's sequence bounds; it runs
                             :func:`actors.backends.packing.packed_attention` eagerly (the varlen
                             flash kernel on CUDA, one SDPA per sequence elsewhere) from cu_seqlens
                             on the device and the same bounds in a host tensor (no sync)

Shapes are dynamic from the first compilation, so a new packed length N (padded: B, T) reuses the
graphs: a region compiles once per grad mode (compute_logprobs' forward, the training forward and
its backward), 4 graphs in all (5 under activation checkpointing), all on the first calls.
:class:`CompileWatch` times the calls that compiled (``train/compile_s``).

The op's backward recomputes the attention under autograd (its forward keeps no autograd state):
one more attention forward per layer in the backward pass, small next to the layer's matmuls on
rows of a few hundred tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch
import transformers
from torch._dynamo.utils import counters

from actors.backends.packing import PackedBatch, packed_attention

__all__ = ["PACKED_COMPILED_ATTENTION", "CompileWatch", "compile_context", "compile_model",
           "compiled_attention_kwargs"]

#: The attention implementation a packed model runs with under ``trainer.compile``.
PACKED_COMPILED_ATTENTION = "asyncrl_packed_op"
_log = logging.getLogger(__name__)


def _attention_eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     host_bounds: torch.Tensor, scaling: float) -> torch.Tensor:
    """:func:`packed_attention` on ``query`` ``[1, H, N, D]``, ``key`` / ``value`` ``[1, H_kv, N, D]``;
    ``[1, N, H, D]``. ``host_bounds``: ``cu_seqlens`` as a CPU tensor (read without a sync)."""
    bounds = tuple(host_bounds.tolist())
    max_len = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    out, _ = packed_attention(None, query, key, value, None, scaling=scaling, cu_seq_lens_q=cu_seqlens,
                              max_length_q=max_len, packed_seq_bounds=bounds)
    return out


@torch.library.custom_op("asyncrl::packed_attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                  host_bounds: torch.Tensor, scaling: float) -> torch.Tensor:
    # contiguous: the layout the fake below promises (the per-sequence path returns a transposed view)
    return _attention_eager(query, key, value, cu_seqlens, host_bounds, scaling).contiguous()


@_attention_op.register_fake
def _(query, key, value, cu_seqlens, host_bounds, scaling):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


@torch.library.custom_op("asyncrl::packed_attention_backward", mutates_args=())
def _attention_backward_op(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           cu_seqlens: torch.Tensor, host_bounds: torch.Tensor,
                           scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # A custom op's body runs below the autograd dispatch key; the recompute needs it back
    # (torch.func.vjp would not do: it refuses the varlen kernel's autograd.Function).
    with torch._C._PreserveDispatchKeyGuard(), torch.enable_grad():
        torch._C._dispatch_tls_set_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality, False)
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        out = _attention_eager(q, k, v, cu_seqlens, host_bounds, scaling)
        grads = torch.autograd.grad(out, (q, k, v), grad)
    return tuple(g.contiguous() for g in grads)


@_attention_backward_op.register_fake
def _(grad, query, key, value, cu_seqlens, host_bounds, scaling):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, cu_seqlens, host_bounds, scaling = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens, host_bounds)
    ctx.scaling = scaling


def _backward(ctx, grad: torch.Tensor):
    query, key, value, cu_seqlens, host_bounds = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(grad, query, key, value, cu_seqlens, host_bounds, ctx.scaling)
    return dq, dk, dv, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _packed_attention_op(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                         packed_host_bounds: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`packed_attention` behind the custom op (Hugging Face's attention signature):
    what a compiled layer calls, with :func:`compiled_attention_kwargs`' inputs."""
    if cu_seq_lens_q is None or packed_host_bounds is None:
        raise RuntimeError(f"attn_implementation={PACKED_COMPILED_ATTENTION!r} needs cu_seq_lens_q and "
                           f"packed_host_bounds (compiled_attention_kwargs of a packed batch)")
    assert query.shape[0] == 1 and attention_mask is None and dropout == 0.0 and sliding_window is None
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _attention_op(query, key, value, cu_seq_lens_q, packed_host_bounds, float(scaling)), None


def compiled_attention_kwargs(batch: PackedBatch) -> dict:
    """What the model's forward passes down to the compiled packed attention: tensors only, since a
    Python int or tuple there would be a guard (a recompilation per sequence count or max length)."""
    return {"cu_seq_lens_q": batch.cu_seqlens, "packed_host_bounds": torch.tensor(batch.seq_bounds)}


def compile_model(model: transformers.PreTrainedModel) -> None:
    """Compile each decoder layer and the final norm of ``model`` in place (lazily: the first
    forward compiles). Raises ``ValueError`` naming ``trainer.compile`` for a model without
    ``model.get_decoder().layers``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"trainer.compile: {type(model).__name__} has no decoder layers "
                         f"(model.get_decoder().layers) to compile")
    for layer in layers:
        layer.compile(dynamic=True)
    if isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        decoder.norm.compile(dynamic=True)


def compile_context(activation_checkpointing: bool) -> contextlib.AbstractContextManager:
    """Where the compiled model's forward runs. Under activation checkpointing, dynamo would stop at
    a Python side effect inside the checkpointed layer (the ``kernels`` package's bookkeeping of
    hub kernels, which recomputing need not replay) and fall back to eager: it is told to skip it."""
    flag = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    if activation_checkpointing and hasattr(torch._dynamo.config, flag):
        return torch._dynamo.config.patch({flag: True})
    return contextlib.nullcontext()


class CompileWatch:
    """Seconds and graphs compiled during the calls it wraps (dynamo's process-wide graph count:
    the trainer process compiles nothing else). A call that compiled counts whole: its own run
    time is small next to the compilation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.graphs = 0

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        before, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        try:
            yield
        finally:
            new = counters["stats"]["unique_graphs"] - before
            if new:
                seconds = time.perf_counter() - t0
                self.seconds, self.graphs = self.seconds + seconds, self.graphs + new
                _log.info("trainer.compile: %s compiled %d graph(s) in %.1f s (%d in %.1f s so far)",
                          what, new, seconds, self.graphs, self.seconds)


transformers.AttentionInterface.register(PACKED_COMPILED_ATTENTION, _packed_attention_op)
