"""Multi-token prediction in the megatron backend: megatron-core's own MTP block
(``TransformerConfig.mtp_num_layers``, ``get_gpt_mtp_block_spec``), driven for RL.

    forward(ids [B, L], labels = ids shifted left, loss_mask [B, L] = 1 where the label is a
            response token)
        GPTModel: decoder ─► MTP block ─► per module k: output_layer ─► CE against labels
                  shifted k + 1 more, masked by loss_mask shifted likewise (the spec's
                  response targets t[i+k+2]), injected into the backward by MTPLossAutoScaler
                  with weight mtp_loss_scaling_factor (= trainer.mtp_loss_weight) x the scale
                  set here (1 / the batch's response tokens) ─► main output_layer ─► (its LM loss,
                  unused)
        a hook on output_layer keeps copies of its outputs: the K modules' logits (metrics mtp/loss_k,
        mtp/acc_k, no gradient) and the main logits, gathered over TP, whose log-probs the
        policy loss takes as without MTP

So the MTP loss is a per-response-token sum divided by the batch's response tokens, as in
the torch backend (megatron-core >= 0.19 rescales each module's by response tokens / its
targets, which differ only for prompts shorter than k + 2 tokens). What megatron-core's MTP
cannot serve, refused by :func:`mtp_unsupported`: more than one module (it feeds module
k + 1 the output of module k after module k's final norm; the spec, and the engine, feed the
output before it).
"""

from __future__ import annotations

import torch

__all__ = ["MegatronMtp", "mtp_block_spec", "mtp_unsupported"]


def mtp_unsupported(mtp_layers: int) -> str | None:
    """Why megatron-core's MTP cannot give the spec's ``mtp_layers`` modules (one line), or None."""
    if mtp_layers > 1:
        return (f"model.mtp_layers: {mtp_layers} needs backend: torch; megatron-core's MTP feeds module k + 1 "
                f"the normed output of module k, the MTP spec (and the engine) the output before that norm, "
                f"so the megatron backend runs model.mtp_layers: 1 only")
    return None


def mtp_block_spec(config: object, layer_spec: object) -> object:
    """megatron-core's MTP block spec for the local (no Transformer Engine) layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec  # optional dependency

    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)


class MegatronMtp:
    """Runs a Megatron ``GPTModel`` built with an MTP block (module docstring): :meth:`logits`
    in place of a plain forward, :meth:`take` for the metrics of the last training forward."""

    def __init__(self, model: torch.nn.Module, num_mtp: int, vocab_size: int, tp_group: object,
                 tp_size: int) -> None:
        self.num_mtp, self.vocab_size, self.tp_group, self.tp_size = num_mtp, vocab_size, tp_group, tp_size
        self._outputs: list[torch.Tensor] | None = None
        self._metrics: dict[str, torch.Tensor | float] | None = None
        model.output_layer.register_forward_hook(self._on_output)

    def _on_output(self, module: torch.nn.Module, args: tuple, output: tuple) -> None:
        if self._outputs is not None:
            # a copy: megatron-core's cross-entropy (the MTP loss, the unused LM loss) works in
            # place on the logits it is given (one more [L, B, V / TP] tensor per call)
            self._outputs.append((output[0] if isinstance(output, tuple) else output).clone())

    @staticmethod
    def set_scale(scale: float) -> None:
        """The factor on the MTP loss's gradient: 1 / the (global) batch's response tokens."""
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler  # optional dependency

        MTPLossAutoScaler.set_loss_scale(torch.tensor(scale))

    def logits(self, module: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
               **kwargs: object) -> torch.Tensor:
        """``[B, L, V]`` main logits of ``module(input_ids=ids, **kwargs)`` with the MTP labels
        and mask built from the response positions ``pos`` / ``mask`` ``[B, T]`` (padded_batch's)."""
        labels = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1)], dim=1)
        loss_mask = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        loss_mask.scatter_add_(1, pos, mask)  # label at P - 1 + j is response token j (padding adds 0)
        self._outputs = []
        try:
            module(input_ids=ids, labels=labels, loss_mask=loss_mask, **kwargs)
            outputs = self._outputs
        finally:
            self._outputs = None
        assert len(outputs) == self.num_mtp + 1, f"output_layer ran {len(outputs)} times, not {self.num_mtp + 1}"
        if torch.is_grad_enabled():
            self._metrics = self._module_metrics(outputs[:-1], ids, loss_mask)
        main = self._gathered(outputs[-1])  # [L, B, Vp]: the vocabulary whole on every TP rank
        return main.transpose(0, 1)[..., : self.vocab_size]

    def _gathered(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return logits
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region  # optional dependency

        return gather_from_tensor_model_parallel_region(logits)

    @torch.no_grad()
    def _module_metrics(self, outputs: list[torch.Tensor], ids: torch.Tensor,
                        loss_mask: torch.Tensor) -> dict[str, torch.Tensor | float]:
        """``mtp/loss_k`` and ``mtp/acc_k`` summed over module k's targets / response tokens."""
        num_resp = max(float(loss_mask.sum()), 1.0)
        out: dict[str, torch.Tensor | float] = {}
        for k, logits in enumerate(outputs):
            shift = k + 1
            mask = torch.zeros_like(loss_mask)
            mask[:, : ids.shape[1] - shift] = loss_mask[:, shift:]  # the label at i + k + 1 is t[i+k+2]
            targets = torch.zeros_like(ids)
            targets[:, : ids.shape[1] - shift - 1] = ids[:, shift + 1:]
            rows = mask.transpose(0, 1).reshape(-1).nonzero().squeeze(1)  # logits are [L, B, V]
            full = self._gathered(logits.detach().flatten(0, 1).index_select(0, rows))[:, : self.vocab_size].float()
            tgt = targets.transpose(0, 1).reshape(-1).index_select(0, rows)
            logp = torch.log_softmax(full, dim=-1)
            out[f"mtp/loss_{k}"] = -logp.gather(1, tgt[:, None]).sum() / num_resp
            out[f"mtp/acc_{k}"] = (full.argmax(-1) == tgt).sum().float() / num_resp
        return out

    def take(self) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """(0, the metrics of the last training forward): the loss itself is already in that
        forward's graph (MTPLossAutoScaler)."""
        metrics, self._metrics = self._metrics, None
        if metrics is None:
            raise RuntimeError("no MTP metrics: no training forward ran since the last take()")
        return torch.zeros(()), metrics

