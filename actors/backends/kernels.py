"""``trainer.kernels: liger``: the torch backend's Hugging Face model runs Liger-Kernel's fused
Triton kernels (the ``liger`` extra) for RMSNorm, the SwiGLU MLP and RoPE instead of eager's
separate elementwise kernels: fewer launches and one read of each activation where eager makes
several, which is where a small model's step goes (SmolLM2-135M, 64 x ~200-token samples: 960
``mul`` and 1,260 ``copy_`` kernels a step, each a few microseconds).

Only the model given is changed. Liger patches an instance's norms and MLPs (their ``forward``)
and, for later models, the family's classes and its module-level ``apply_rotary_pos_emb``:
:func:`apply_kernels` puts the classes back, and leaves in the modeling module a RoPE that runs
Liger's kernel only inside :func:`kernels_scope` (the backend opens it around its forwards and
backwards), the model's own otherwise. So another model of the family in the same process (a
reference policy, a bench's eager row) stays eager. Liger's fused cross entropy is left off: the
packed path's chunked log-probs already keep full-vocabulary logits out of memory and return
log-probs, not a loss. The norms then run :mod:`actors.backends.norm_kernels`' RMSNorm, whose
backward takes rows a tile at a time where Liger's walks them one by one. Triton kernels need a
CUDA device: ``trainer.device`` must be ``cuda``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator

import torch

__all__ = ["KERNELS", "apply_kernels", "kernels_scope", "kernels_unavailable"]

KERNELS = ("eager", "liger")
_FUSED = {"rope": False, "rms_norm": True, "swiglu": True, "cross_entropy": False,
          "fused_linear_cross_entropy": False}  # rope: installed scoped, below
_ROPE = "apply_rotary_pos_emb"
_liger_rope_depth = 0  # > 0 inside kernels_scope("liger")


def kernels_unavailable(kernels: str, device: str | None) -> str | None:
    """Why ``trainer.kernels`` = ``kernels`` cannot run on ``device`` in this build, or None."""
    if kernels == "eager":
        return None
    if kernels not in KERNELS:
        return f"{kernels!r} is unknown (expected one of: {', '.join(KERNELS)})"
    if device is not None and not str(device).startswith("cuda"):
        return f"{kernels!r} runs Triton kernels, which need trainer.device=cuda (got {str(device)!r})"
    from actors.backends.config import import_error

    why = import_error("liger_kernel.transformers")
    if why is not None:
        return f"{kernels!r} needs liger-kernel, which {why}; install the optional extra: pip install -e \".[liger]\""
    return None


def apply_kernels(model: torch.nn.Module, kernels: str) -> None:
    """Patch ``model`` in place to run ``kernels`` (``eager``: nothing). Raises ``ValueError``
    naming ``trainer.kernels`` for a model family Liger does not cover."""
    if kernels == "eager":
        return
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    from actors.backends import norm_kernels

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    modeling = sys.modules.get(type(model).__module__)
    if apply is None or not callable(getattr(modeling, _ROPE, None)):
        raise ValueError(f"trainer.kernels: liger has no kernels for model type {model_type!r} "
                         f"(it covers e.g. llama, qwen2, qwen3, mistral); set trainer.kernels=eager")
    classes = {name: value for name, value in vars(modeling).items() if isinstance(value, type)}
    accepted = inspect.signature(apply).parameters
    apply(model=model, **{k: v for k, v in _FUSED.items() if k in accepted})
    for name, value in classes.items():  # the instance keeps Liger's forwards; later models are built eager
        setattr(modeling, name, value)
    own = getattr(modeling, _ROPE)
    if not getattr(own, "liger_scoped", False):
        def scoped_rope(q, k, cos, sin, *args, **kwargs):
            return (liger_rotary_pos_emb if _liger_rope_depth else own)(q, k, cos, sin, *args, **kwargs)

        scoped_rope.liger_scoped = True
        setattr(modeling, _ROPE, scoped_rope)
    # Liger's RMSNorm backward runs one program per SM, each walking ~100 rows one after another
    # (SmolLM2-135M: 83 us a call, 5 of a 61 ms step); ours takes a tile of rows per program.
    norm_kernels.patch_rms_norms(model)


@contextlib.contextmanager
def kernels_scope(kernels: str) -> Iterator[None]:
    """While open (``liger``), the RoPE of models :func:`apply_kernels` saw is Liger's."""
    global _liger_rope_depth
    if kernels == "eager":
        yield
        return
    _liger_rope_depth += 1
    try:
        yield
    finally:
        _liger_rope_depth -= 1
