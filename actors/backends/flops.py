"""Model FLOPs of a training step and model-FLOPs utilisation (MFU).

A step's model FLOPs are the forward and backward passes over every token of
every trained sequence (prompt and response): ``6 N T`` for the matmuls, with
``N`` the parameters a token meets in a matmul (all but the input embedding;
the output head counts even when tied to it), plus ``6 L d T^2`` for causal
attention scores and mixing (``L`` layers, ``d`` = heads x head_dim). A
log-prob recompute, padding and activation recomputation are not counted, so
MFU is the useful share of the device's dense peak, as PaLM defines it. With K
MTP modules (``model.mtp_layers``) each adds its decoder layer and ``eh_proj`` over
every token (and its attention term), and the head over the response tokens it scores.
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
    #: ``model.mtp_layers`` K, and per MTP module the matmul parameters every token meets (its
    #: decoder layer and ``eh_proj``) and the head's, which only the scored (response) tokens meet
    mtp_layers: int = 0
    mtp_module_params: int = 0
    head_params: int = 0

    @classmethod
    def from_model_dir(cls, path: str | pathlib.Path, mtp_layers: int = 0) -> FlopsModel:
        """From a Hugging Face model directory's ``config.json`` (the model is
        built on the meta device to count its parameters: no memory, no weights);
        ``mtp_layers``: the MTP modules trained beside it (docs/mtp.md)."""
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
        hidden = raw["hidden_size"]
        layer = sum(p.numel() for p in model.get_decoder().layers[-1].parameters())
        return cls(matmul_params=total if tied else total - embed,
                   num_layers=raw["num_hidden_layers"], attn_width=heads * head_dim, mtp_layers=mtp_layers,
                   mtp_module_params=layer + 2 * hidden * hidden + 3 * hidden, head_params=embed)

    def train_flops(self, seq_lens: Sequence[int], response_lens: Sequence[int] = ()) -> float:
        """Forward + backward model FLOPs over sequences of these lengths; with MTP modules, each
        module's layer over every token and the head over the ``response_lens`` tokens too."""
        per_token = self.matmul_params + self.mtp_layers * self.mtp_module_params
        layers = self.num_layers + self.mtp_layers
        return float(sum(6 * per_token * t + 6 * layers * self.attn_width * t * t for t in seq_lens)
                     + 6 * self.mtp_layers * self.head_params * sum(response_lens))


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
