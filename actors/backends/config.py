"""TrainerConfig: the ``trainer`` section, the one set of trainer defaults.

:func:`actors.backends.make_backend` builds the backend its ``backend`` names
(:mod:`actors.backends.registry`) from it; the built-in
:class:`~actors.backends.torch_backend.TorchBackend` takes its keyword
defaults from it too. The loss fields (``loss``, ``clip_eps``, ``is_cap``, ``is_cap_mode``, ``clip_ratio_c``) are
read by the composition root, which builds the loss object the backend runs
(``policies.losses.make_loss_from_config``).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = ["MuonConfig", "TrainerConfig", "import_error"]

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]


class MuonConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``trainer.optimizer: muon``: Muon (``torch.optim.Muon``) for the 2-D hidden weights,
    AdamW (``trainer.lr``, ``trainer.weight_decay``) for embeddings, head, norms and biases
    (:mod:`actors.backends.optimizers`; what it costs and where it pays: docs/optimizers.md)."""

    lr: PosFloat | None = None
    """Muon's learning rate; ``null``: ``trainer.lr``, which the AdamW-matched
    ``adjust_lr`` scales are made to take."""
    momentum: Annotated[float, Meta(ge=0, lt=1)] = 0.95
    """Muon's momentum (Nesterov)."""
    adjust_lr: Literal["match_rms_adamw", "match_adamw_update_rms", "original"] = "match_rms_adamw"
    """How each matrix's step is scaled by its shape ``[A, B]``: ``match_rms_adamw``
    0.2 sqrt(max(A, B)) (Moonlight's: an update of AdamW's typical RMS, so AdamW's lr carries
    over); ``match_adamw_update_rms`` the same with sqrt((1 - beta1) / (1 + beta1)) (0.229)
    for 0.2, the RMS of AdamW's update on noisy gradients (verl's ``muon_match_adamw_update_rms``);
    ``original`` sqrt(max(1, A / B)) (Keller Jordan's; wants a Muon-sized lr, ~0.02)."""


class TrainerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The trainer backend, its optimizer, its loss and its batch."""

    backend: str = "torch"
    """Trainer backend: a registered name or the import path ``package.module:attr`` of a
    backend's factory (:mod:`actors.backends.registry`). ``torch`` is built in;
    ``megatron`` needs megatron-core (the ``megatron`` extra) and ``device: cuda``."""
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the model's params and compute. ``auto`` (resolved when the config is
    read, so the run's saved config holds the dtype chosen): ``bfloat16`` when
    ``device`` is ``cuda[:i]`` (the varlen flash attention and CUDA graphs need it; half
    the memory), ``float32`` elsewhere."""
    master_dtype: Literal["float32", "bfloat16"] | None = "float32"
    """Dtype of the optimizer's main params when ``dtype`` is lower (fp32 main params,
    Megatron-style: AdamW steps them, the model keeps ``dtype`` copies, which the weight
    sync reads). ``null``: step the model params in ``dtype`` as they are."""
    lr: PosFloat = 1e-5
    """AdamW learning rate (Muon's too, unless ``muon.lr`` sets its own)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """``muon``: Muon for the 2-D hidden weights and AdamW for the rest (``trainer.muon``;
    docs/optimizers.md). ``backend: torch`` only."""
    muon: MuonConfig = msgspec.field(default_factory=MuonConfig)
    weight_decay: NonNegFloat = 0.0
    grad_clip: PosFloat = 1.0
    """Max global grad norm."""
    tensor_parallel_size: PosInt = 1
    """``backend: megatron``: ranks each model is split over (Megatron tensor
    parallel); it must divide the trainer ranks (``num_workers``), the model's
    key/value heads and its FFN width. The rest of the ranks are data parallel."""
    num_workers: PosInt = 1
    """Trainer actors, one process each, forming one torch.distributed group
    (gloo on CPU, NCCL on GPUs): each takes its share of a step's groups from
    the queue, gradients are reduced across them, parameters and optimizer
    state are sharded (FSDP2), and each pushes its shards of the weights.
    Above 1: runtime.type process or ray, batch_prompts a multiple of it."""
    batch_prompts: PosInt = 16
    """Prompts (whole groups) per trainer step; batch size = batch_prompts * rollout.n."""
    loss: Literal["ppo_clip", "decoupled_ppo", "tis_token", "tis_seq"] = "ppo_clip"
    """Policy loss and off-policy correction (see ``policies.losses``)."""
    clip_eps: PosFloat = 0.2
    """PPO clip range (both sides)."""
    is_cap: PosFloat = 2.0
    """Cap of truncated importance weights (tis_* and decoupled_ppo)."""
    is_cap_mode: Literal["truncate", "mask"] = "truncate"
    """decoupled_ppo: a behaviour weight over ``is_cap`` is set to the cap (``truncate``) or drops
    its token from the loss, still counted in the token mean (``mask``, AReaL's default)."""
    clip_ratio_c: PosFloat | None = None
    """Dual-clip PPO (ppo_clip and decoupled_ppo): above 1, a negative-advantage token's term is held
    at ``clip_ratio_c * A``, so a token whose ratio exceeds it adds no gradient (peers' usual 3.0).
    null: off. A sampler far from the trainer (FP8 rollout, long staleness) makes such ratios."""
    micro_batch_tokens: NonNegInt | None = None
    """Tokens per forward pass (gradients accumulated): ``packed``, the sum of
    the sequences' lengths; padded, rows x longest row (rows sorted by length,
    so long-tailed batches stop padding every row to the longest).
    0 = the whole batch in one pass; null = 16384 on CUDA (a small step is
    bound by kernel launches, which every extra pass repeats; docs/benchmarks.md,
    "Trainer step"), 2048 on a CPU (memory)."""
    packed: bool = True
    """Torch backend: pack each micro-batch into one row of concatenated
    sequences (no padding; attention kept within each sequence, by the varlen
    flash kernel on CUDA) and take log-probs from the LM head in chunks of
    ``logprob_chunk_tokens`` response tokens. A model it does not support (not
    Llama / Qwen2 / Qwen3 / Mistral, a sliding window, soft-capped or scaled
    logits) trains padded, as with ``false``, and the log says why. The megatron
    backend always pads."""
    logprob_chunk_tokens: PosInt = 2048
    """``packed``: response tokens whose full-vocabulary logits exist at once
    (fp32 ``[chunk, vocab]``, forward and backward)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead
    of keeping them (less memory for long sequences, ~1/3 more compute).
    Torch backend only."""
    compile: bool = False
    """Torch backend: ``torch.compile`` each decoder layer and the final norm
    (regional: the layers share one compilation; shapes dynamic, so a new batch
    length reuses it; the packed attention an opaque op inside the graph). Fuses
    what eager runs as separate kernels (RMSNorm, RoPE, the SwiGLU product,
    residual adds), which pays where a step is bound by kernel launches and host
    overhead: small models, short rows (SmolLM2-135M launches ~3600 kernels a
    step eager). Costs one compilation on the first steps (seconds to a minute,
    logged, ``train/compile_s``) and, packed, one more attention forward per
    layer in the backward. Only with ``backend: torch`` and one worker (``num_workers: 1``, no FSDP2)."""
    kernels: Literal["auto", "eager", "liger"] = "auto"
    """Torch backend: ``liger`` runs Liger-Kernel's fused Triton kernels for
    the SwiGLU MLP and RoPE (:mod:`actors.backends.kernels`; the ``liger``
    extra, ``trainer.device=cuda``) where ``eager`` runs the model's own
    PyTorch ops, Llama-style RMSNorms in Triton with a row-tiled backward
    (:mod:`actors.backends.norm_kernels`), and the head's log-softmax and
    entropy as one Triton pass over each chunk's logits
    (:mod:`actors.backends.head_kernels`). Fewer
    kernel launches and passes a step, as ``compile`` gives without its
    compilation; not with ``compile`` (dynamo cannot trace Liger's RMSNorm
    here: torch 2.11). ``auto`` (resolved when the config is read): ``liger`` with
    ``backend: torch`` on ``device: cuda``, ``compile`` false and liger-kernel
    installed, else ``eager``."""
    cuda_graphs: bool | None = None
    """Torch backend: replay each training micro-batch's forward and backward as CUDA
    graphs (:mod:`actors.backends.graphs`), captured once per padded shape: the
    tokens rounded up to a multiple of 2048, the sequences and the longest one
    bucketed likewise. For steps bound by the host's kernel launches (small models,
    short rows: SmolLM2-135M's ~4,500 launches a step eager). A run meets a few
    shapes; each new one costs a capture (``train/graph_capture_s`` times it) and keeps
    its activations' memory in one shared pool. Needs ``device: cuda``, ``dtype: bfloat16``,
    ``packed``, one worker; not with ``compile`` or ``activation_checkpointing``.
    Works with ``kernels: liger``. A model that cannot pack (``packed``) trains padded
    without graphs, and the log says why. ``null`` (auto, resolved when the config is
    read): true where all of those needs are met (and this torch has the varlen
    attention), else false."""
    mtp_loss_weight: NonNegFloat = 0.1
    """With ``model.mtp_layers`` K > 0: the weight of the MTP modules' auxiliary loss, the mean
    over modules of each one's token-mean cross-entropy on the response tokens k + 2 ahead,
    added to the policy loss (docs/mtp.md). It trains the MTP modules (what the engine drafts
    with), and with ``mtp_detach: false`` the shared trunk, embedding and head too; 0 leaves
    them untrained (their metrics still reported). Costs per step, per module: one more
    decoder layer forward and backward over every token, and the head over the response
    tokens (torch: chunked, forward and backward, plus a no-grad pass for the top-1
    accuracy). Torch backend: not with ``compile``, and ``cuda_graphs`` off; megatron: one
    module at most."""
    mtp_detach: bool = True
    """With ``model.mtp_layers`` K > 0: the auxiliary loss trains the MTP modules alone; they read
    the policy's hidden states, embeddings and head without their gradient, so the policy's
    gradient is the RL loss's (as peers recommend for RL: a joint MTP loss changes what the policy
    learns). ``false``: DeepSeek-style joint training, the loss reaches the whole model. Torch
    backend; the megatron backend (megatron-core's MTP block trains the shared embedding and
    head) needs ``false``."""
    mtp_lr: PosFloat | None = None
    """With ``model.mtp_layers`` K > 0: the MTP modules' learning rate (null: ``lr``). Modules
    added to a checkpoint that has none start from a copy of the last decoder layer and learn
    what the policy's lr lets them (SmolLM2-135M, lr 1e-5, 100 steps: 29% next-next-token
    accuracy); a higher rate trains the draft faster without moving the policy
    (``mtp_detach: true``). Muon's matrices among them take Muon's lr scaled by ``mtp_lr / lr``.
    Torch backend only."""
    peak_tflops: PosFloat | None = None
    """The device's dense peak TFLOP/s for ``dtype`` matmuls, for ``train/mfu``
    (null: known for H100 / H200 / A100, no MFU elsewhere; ``train/tflops`` is
    logged either way)."""

    def __post_init__(self) -> None:
        self._resolve_auto()
        if self.compile and self.backend != "torch":
            raise ValueError(f"compile must be false with backend {self.backend!r} (it compiles the torch "
                             f"backend's Hugging Face model)")
        if self.kernels != "eager" and self.backend != "torch":
            raise ValueError(f"kernels must be eager with backend {self.backend!r} (it patches the torch "
                             f"backend's Hugging Face model)")
        if self.kernels != "eager" and self.compile:
            raise ValueError(f"kernels must be eager with compile true (dynamo cannot trace {self.kernels}'s "
                             f"kernels here); choose one")
        if self.activation_checkpointing and self.backend == "megatron":
            raise ValueError("activation_checkpointing must be false with backend 'megatron' (it does not offer "
                             "it in this build; backend: torch does)")
        if self.cuda_graphs and self.backend != "torch":
            raise ValueError(f"cuda_graphs must be false with backend {self.backend!r} (it graphs the torch "
                             f"backend's packed passes)")
        if self.cuda_graphs and self.compile:
            raise ValueError("cuda_graphs must be false with compile true (the compiled packed attention reads "
                             "sequence bounds on the host, which a graph would freeze); choose one")
        if self.cuda_graphs and self.num_workers > 1:
            raise ValueError(f"cuda_graphs must be false with num_workers={self.num_workers} (one worker only)")
        if self.cuda_graphs and (self.activation_checkpointing or not self.packed):
            raise ValueError("cuda_graphs must be false with packed false or activation_checkpointing true")
        if self.cuda_graphs and (not self.device.startswith("cuda") or self.dtype != "bfloat16"):
            raise ValueError(f"cuda_graphs must be false unless device is cuda and dtype bfloat16 (the varlen "
                             f"flash attention); got device {self.device!r}, dtype {self.dtype!r}")
        if self.is_cap_mode != "truncate" and self.loss != "decoupled_ppo":
            raise ValueError(f"is_cap_mode must be truncate with loss {self.loss!r} (mask is decoupled_ppo's)")
        if self.clip_ratio_c is not None and (self.clip_ratio_c <= 1.0 or self.loss not in ("ppo_clip", "decoupled_ppo")):
            raise ValueError(f"clip_ratio_c must be null or above 1 with loss ppo_clip or decoupled_ppo; got "
                             f"{self.clip_ratio_c} with loss {self.loss!r}")
        if self.mtp_lr is not None and self.backend != "torch":
            raise ValueError(f"mtp_lr must be null with backend {self.backend!r} (its optimizer takes one lr for "
                             f"every parameter); backend: torch has it")
        if self.optimizer == "muon" and self.backend != "torch":
            raise ValueError(f"optimizer must be adamw with backend {self.backend!r}: it steps Megatron's distributed "
                             f"optimizer, under which megatron-core's Muon (it needs the emerging-optimizers "
                             f"package) does not run; backend: torch has muon")
        if self.compile and self.num_workers > 1:
            raise ValueError(f"compile must be false with num_workers={self.num_workers} (compiled layers "
                             f"under FSDP2's hooks are untested here; one worker only)")

    def _resolve_auto(self) -> None:
        """Replace ``auto`` / ``null`` by what runs fastest here, once, when the section is
        built (read from a config, or made in code): every reader, and the run's saved
        config, sees a concrete value; a value the user gave is kept as given (and
        checked by :meth:`__post_init__` as such)."""
        cuda = self.device.startswith("cuda")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if cuda else "float32"
        torch_on_gpu = self.backend == "torch" and cuda and not self.compile  # compile rules out both
        if self.kernels == "auto":
            from actors.backends.kernels import kernels_unavailable  # imports torch: only here

            self.kernels = "liger" if torch_on_gpu and kernels_unavailable("liger", self.device) is None else "eager"
        if self.cuda_graphs is None:
            self.cuda_graphs = (torch_on_gpu and self.dtype == "bfloat16" and self.packed and self.num_workers == 1
                                and not self.activation_checkpointing and _varlen_available())


def _varlen_available() -> bool:
    """Whether this torch has the varlen flash attention CUDA graphs need (imports the
    packing module, hence transformers: only asked for a CUDA config)."""
    from actors.backends.packing import varlen_available

    return varlen_available()


def import_error(module: str) -> str | None:
    """Why ``module`` does not import here (``"is not installed"`` when it is absent), or None.
    Imported for real (megatron.core: a few seconds, only when a config names it), so a
    broken install is caught here rather than at setup."""
    try:
        with warnings.catch_warnings():  # megatron warns that Apex / Transformer Engine are absent
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            return "is not installed"
        return f"does not import here ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - any failure to import is the reason
        return f"does not import here ({type(e).__name__}: {e})"
    return None
