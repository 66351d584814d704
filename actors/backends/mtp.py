"""Multi-token prediction (MTP) modules in the torch trainer backend (``model.mtp_layers``; docs/mtp.md).

    HF model + model.mtp = ModuleList([MtpModule] * K)      (state_dict names mtp.{k}.*: every push,
                                                             checkpoint and export carries them)
    forward (the model's own, packed or padded), hooks capture:
        embed_tokens output    emb [B, L, H]
        the last decoder layer's keyword arguments (RoPE cos/sin, the causal mask or the packed
            sequence bounds, position ids): the MTP layers attend exactly as the main ones
        lm_head input          H0 [B, L, H] (after the final norm)
    inside the lm_head's pre-hook (so FSDP2's root still holds its gathered params):
        module k:  H_{k+1} = layer_k(eh_proj(cat[enorm(emb shifted by k+1), hnorm(H_k)]))
                   at the positions whose target t[i+k+2] is a response token of the same
                   sequence: log-prob of it from head(norm_k(H_{k+1})), in chunks
                   (actors.backends.chunked_logprobs), and top-1 hits (a no-grad head pass)
        aux = mtp_loss_weight * mean_k(CE_k summed / response tokens)   added to the RL loss, one backward

Positions near a sequence's end read a shifted embedding from past it (the next packed
sequence's, or zeros); causal attention keeps that from every position whose target
is scored. No gradient-free pass (``compute_logprobs``, proximal log-probs) runs the modules.
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from actors.backends.batching import to_device
from actors.backends.chunked_logprobs import chunked_logprobs
from actors.backends.mtp_weights import mtp_state, read_mtp_tensors
from actors.backends.packing import PACKED_ATTENTION
from contracts.sample import Sample

__all__ = ["MtpModule", "MtpRunner", "attach_mtp", "mtp_logits", "mtp_positions"]

#: aux loss and metrics of a training forward, as :func:`actors.backends.loss_pass.accumulate` takes them
AuxResult = tuple[torch.Tensor, dict[str, torch.Tensor | float]]


class MtpModule(torch.nn.Module):
    """One MTP module of the spec: ``enorm``, ``hnorm`` (the model's RMSNorm class), ``eh_proj``
    (Linear 2h -> h, no bias), ``layer`` (a copy of the model's last decoder layer, so its
    attention implementation, RoPE and kernels are the main layers'), ``norm``."""

    def __init__(self, model: transformers.PreTrainedModel) -> None:
        super().__init__()
        body = model.get_decoder()
        norm = body.norm
        h = norm.weight.shape[0]
        def copied(module: torch.nn.Module) -> torch.nn.Module:
            # the config stays shared: set_attn_implementation (packing) then reaches this layer too
            return copy.deepcopy(module, {id(model.config): model.config})

        self.enorm, self.hnorm = copied(norm), copied(norm)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False, device=norm.weight.device, dtype=norm.weight.dtype)
        self.layer = copied(body.layers[-1])
        self.norm = copied(norm)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
        """``H_{k+1}`` ``[B, L, H]`` (before ``norm``) from the shifted embeddings and ``H_k``."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        out = self.layer(x, **layer_kwargs)  # hidden states positional, as the model calls its layers
        return out[0] if isinstance(out, tuple) else out


def attach_mtp(model: transformers.PreTrainedModel, num_mtp: int, model_dir: str | pathlib.Path) -> None:
    """Add ``model.mtp``: ``num_mtp`` modules, the checkpoint's where ``model_dir`` has them, else
    initialised per the spec (:mod:`actors.backends.mtp_weights`); ValueError (one line) for a
    checkpoint with more modules than ``num_mtp`` or a model without decoder layers."""
    body = model.get_decoder()
    if not isinstance(getattr(body, "layers", None), torch.nn.ModuleList) or not hasattr(body, "norm"):
        raise ValueError(f"model.mtp_layers: {type(model).__name__} has no decoder layers and final norm to "
                         f"build MTP modules from")
    if hasattr(model, "mtp"):
        raise RuntimeError(f"{type(model).__name__} already has an attribute 'mtp'")
    num_layers = len(body.layers)
    hf = {n: t for n, t in model.state_dict().items() if n.startswith(f"model.layers.{num_layers - 1}.")}
    hf["model.norm.weight"] = body.norm.weight
    state = mtp_state(read_mtp_tensors(model_dir), hf, num_mtp, num_layers, where=f"model {str(model_dir)!r}")
    model.mtp = torch.nn.ModuleList([MtpModule(model) for _ in range(num_mtp)])
    missing, unexpected = model.mtp.load_state_dict({n[len("mtp."):]: t for n, t in state.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)


def mtp_positions(samples: Sequence[Sample], starts: Sequence[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Module ``k``'s scored positions in the flattened batch (sample i's tokens start at
    ``starts[i]``) and their targets: every i whose t[i+k+2] is a response token of the same
    sequence (``int64`` arrays, sample by sample)."""
    pos, tgt = [], []
    for s, o in zip(samples, starts):
        p, n = len(s.prompt_ids), len(s.response_ids)
        first, last = max(0, p - k - 2), p + n - k - 3  # local positions, inclusive
        if last < first:
            continue
        seq = np.concatenate([np.asarray(s.prompt_ids, dtype=np.int64), np.asarray(s.response_ids, dtype=np.int64)])
        local = np.arange(first, last + 1)
        pos.append(local + int(o))
        tgt.append(seq[local + k + 2])
    if not pos:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(pos).astype(np.int64), np.concatenate(tgt)


def _shifted(emb: torch.Tensor, shift: int) -> torch.Tensor:
    """``emb`` ``[B, L, H]`` moved ``shift`` places left along L, zeros after the end."""
    if shift >= emb.shape[1]:
        return torch.zeros_like(emb)
    return torch.cat([emb[:, shift:], emb.new_zeros(emb.shape[0], shift, emb.shape[2])], dim=1)


@torch.no_grad()
def _hits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
          chunk_tokens: int) -> torch.Tensor:
    """How many of ``targets`` are the head's top-1 over ``hidden`` ``[T, H]`` (0-d, fp32), a chunk at a time."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk_tokens):
        e = min(s + chunk_tokens, hidden.shape[0])
        total += (F.linear(hidden[s:e], weight, bias).argmax(-1) == targets[s:e]).sum()
    return total


class MtpRunner:
    """Runs ``model.mtp`` inside the model's forward (hooks; module docstring) when armed.

    ``weight``: ``trainer.mtp_loss_weight``; ``chunk_tokens``: the head's chunk
    (``trainer.logprob_chunk_tokens``); ``fused``: the Triton head kernels (``kernels: liger``);
    ``detach`` (``trainer.mtp_detach``): the modules read ``H0``, the embeddings and the head
    without their gradient, so the aux loss trains the modules alone."""

    def __init__(self, model: transformers.PreTrainedModel, weight: float, chunk_tokens: int,
                 fused: bool = False, detach: bool = True) -> None:
        self.model, self.weight, self.chunk_tokens, self.fused = model, weight, chunk_tokens, fused
        self.detach = detach  # trainer.mtp_detach: the loss reaches the modules only
        self.modules: torch.nn.ModuleList = model.mtp
        self._job: Callable[[torch.Tensor], None] | None = None
        self._emb: torch.Tensor | None = None
        self._layer_kwargs: dict | None = None
        self._result: AuxResult | None = None
        body = model.get_decoder()
        self._hooks = [
            body.get_input_embeddings().register_forward_hook(self._on_embeddings),
            body.layers[-1].register_forward_pre_hook(self._on_last_layer, with_kwargs=True),
            model.get_output_embeddings().register_forward_pre_hook(self._on_head),
        ]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._hooks:
            h.remove()

    # -- hooks: capture while armed, run the job at the head ----------------------------

    def _on_embeddings(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._job is not None:
            self._emb = output

    def _on_last_layer(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._job is not None:
            self._layer_kwargs = dict(kwargs)

    def _on_head(self, module: torch.nn.Module, args: tuple) -> None:
        job, self._job = self._job, None
        if job is not None:
            try:
                job(args[0])
            finally:
                self._emb = self._layer_kwargs = None

    def _run(self, hidden: torch.Tensor, detach: bool = False) -> list[torch.Tensor]:
        """Every module's ``H_{k+1}`` ``[B, L, H]`` from ``H0`` = ``hidden`` (``detach``: read
        ``H0`` and the embeddings without their gradient)."""
        assert self._emb is not None and self._layer_kwargs is not None, "the model's forward bypassed a hook"
        emb = self._emb.detach() if detach else self._emb
        hidden = hidden.detach() if detach else hidden
        out = []
        for k, module in enumerate(self.modules):
            hidden = module(_shifted(emb, k + 1), hidden, self._layer_kwargs)
            out.append(hidden)
        return out

    # -- training ----------------------------------------------------------------------

    def arm(self, samples: Sequence[Sample], starts: Sequence[int]) -> None:
        """The next forward computes the aux loss over ``samples`` (sample i's tokens start at
        flat index ``starts[i]`` of the ``[B, L]`` input); :meth:`take` returns it. Nothing
        without gradients (a log-prob pass)."""
        if not torch.is_grad_enabled():
            return
        host = [a for k in range(len(self.modules)) for a in mtp_positions(samples, starts, k)]
        device = self.modules[0].eh_proj.weight.device
        tensors = to_device(host, device)  # one copy for every module's positions and targets
        # Per response token, as the policy loss: each module's targets are the response tokens
        # (all but those within k + 2 of a sequence's start), and a micro-batch's sum over them,
        # weighted by its share of the batch's response tokens, is then the batch's token mean
        # however the batch is split into micro-batches or over data-parallel ranks.
        n = max(sum(len(s.response_ids) for s in samples), 1)
        self._result = None

        def job(hidden: torch.Tensor) -> None:
            head = self.model.get_output_embeddings()
            weight = head.weight.detach() if self.detach else head.weight
            bias = None if head.bias is None else head.bias.detach() if self.detach else head.bias
            losses, metrics = [], {}
            for k, h in enumerate(self._run(hidden, self.detach)):
                pos, targets = tensors[2 * k], tensors[2 * k + 1]
                sel = self.modules[k].norm(h.flatten(0, 1).index_select(0, pos))  # [T_k, H]
                logprobs, _ = chunked_logprobs(sel, weight, bias, targets, self.chunk_tokens,
                                               with_entropy=False, fused=self.fused)
                losses.append(-logprobs.sum() / n)
                metrics[f"mtp/loss_{k}"] = losses[-1].detach()
                metrics[f"mtp/acc_{k}"] = _hits(sel.detach(), head.weight, head.bias, targets, self.chunk_tokens) / n
            self._result = (self.weight * torch.stack(losses).mean(), metrics)

        self._job = job

    def take(self) -> AuxResult:
        """The aux loss (0-d, in the graph) and ``mtp/loss_k``, ``mtp/acc_k`` of the last armed forward."""
        result, self._result = self._result, None
        if result is None:
            raise RuntimeError("no MTP result: arm() the runner before a forward with gradients")
        return result


@torch.no_grad()
def mtp_logits(source: object, input_ids: Sequence[int] | torch.Tensor) -> list[torch.Tensor]:
    """Each MTP module's logits ``[T, V]`` (fp32) on one sequence ``input_ids`` ``[T]``: row i of
    module k predicts t[i+k+2] (rows past T - k - 2 read zero embeddings and mean nothing).
    ``source``: a set-up torch backend (``mtp_layers`` > 0) or an HF model with ``model.mtp``.
    For comparing with the engine's draft logits."""
    model = getattr(source, "model", source)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "mtp"):
        raise ValueError(f"{type(source).__name__} has no MTP modules (model.mtp_layers: 0?)")
    device = model.mtp[0].eh_proj.weight.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
    length = ids.shape[1]
    kwargs: dict = {"position_ids": torch.arange(length, device=device)[None], "use_cache": False}
    if model.config._attn_implementation == PACKED_ATTENTION:  # one packed sequence
        bounds = torch.tensor([0, length], dtype=torch.int32, device=device)
        kwargs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=length, max_length_k=length,
                      packed_seq_bounds=(0, length))
    runner = MtpRunner(model, weight=0.0, chunk_tokens=1)
    hiddens: list[torch.Tensor] = []
    runner._job = lambda hidden: hiddens.extend(runner._run(hidden))
    try:
        model(input_ids=ids, **kwargs)
    finally:
        runner.remove()
    head = model.get_output_embeddings()
    return [F.linear(module.norm(h[0]), head.weight, head.bias).float() for module, h in zip(model.mtp, hiddens)]
