"""Model FLOPs of a training step and model-FLOPs utilisation (MFU).

A step's model FLOPs are the forward and backward passes over every token of
every trained sequence (prompt and response): ``6 N T`` for the matmuls, with
``N`` the parameters a token meets in a matmul (all but the input embedding;
the output head counts even when tied to it), plus ``6 L d T^2`` for causal
attention scores and mixing (``L`` layers, ``d`` = heads x head_dim). A
log-prob recompute, padding and activation recomputation are not counted, so
MFU is the useful share of the device's dense peak, as PaLM defines it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

import torch

__all__ = ["FlopsModel", "peak_flops"]

#: Dense peak FLOP/s per device (no sparsity) by name and matmul precision.
_PEAKS = {
    "H200": {"bfloat16": 989e12, "tf32": 494.5e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "tf32": 494.5e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12},
}


@dataclasses.dataclass(frozen=True)
class FlopsModel:
    matmul_params: int
    num_layers: int
    attn_width: int

    @classmethod
    def from_model_dir(cls, path: str | pathlib.Path) -> FlopsModel:
        """From a Hugging Face model directory's ``config.json`` (the model is
        built on the meta device to count its parameters: no memory, no weights)."""
        import transformers  # ~2 s to import: the driver imports this module and never needs it

        raw = json.loads((pathlib.Path(path) / "config.json").read_text())
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() for p in model.parameters())  # a tied head is counted once, as the embedding
        embed = model.get_input_embeddings().weight.numel()
        tied = model.get_output_embeddings() is not None and (
            model.get_output_embeddings().weight is model.get_input_embeddings().weight)
        heads = raw.get("num_attention_heads", 1)
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        return cls(matmul_params=total if tied else total - embed,
                   num_layers=raw["num_hidden_layers"], attn_width=heads * head_dim)

    def train_flops(self, seq_lens: Sequence[int]) -> float:
        """Forward + backward model FLOPs over sequences of these lengths."""
        return float(sum(6 * self.matmul_params * t + 6 * self.num_layers * self.attn_width * t * t
                         for t in seq_lens))


def peak_flops(device: str, dtype: str) -> float | None:
    """The device's dense peak FLOP/s for ``dtype`` matmuls (fp32 counts as TF32
    when torch lets matmuls use it), or None where it is not known (CPUs, other
    GPUs: set ``trainer.peak_tflops``)."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    precision = dtype
    if dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"
    for key, peaks in _PEAKS.items():
        if key in name:
            return peaks[precision]
    return None
