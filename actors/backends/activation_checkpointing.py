"""``trainer.activation_checkpointing`` for the torch backend: Hugging Face's per-layer
checkpointing (each decoder layer's activations recomputed in the backward instead of
kept), which runs only in training mode."""

from __future__ import annotations

import torch
import transformers

__all__ = ["enable_activation_checkpointing"]


def enable_activation_checkpointing(model: transformers.PreTrainedModel) -> None:
    """Turn it on and put ``model`` in training mode; ValueError (one line, naming
    ``trainer.activation_checkpointing``) for a model with dropout, which training mode
    would turn on, or one that does not support it."""
    dropout = {k: v for k, v in model.config.to_dict().items()
               if "dropout" in k and isinstance(v, (int, float)) and v > 0}
    if dropout or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        raise ValueError(f"trainer.activation_checkpointing: this model has dropout "
                         f"({dropout or 'a Dropout module'}), which checkpointing's training mode would turn on")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"trainer.activation_checkpointing: {type(model).__name__} does not support it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
