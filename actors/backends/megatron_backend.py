"""The Megatron-core trainer backend: a ``GPTModel`` built from a Hugging Face
Llama / Qwen2 checkpoint, Megatron's distributed optimizer, an injected loss.

    setup:  HF config ─► TransformerConfig + get_gpt_layer_local_spec (no Transformer Engine)
            HF safetensors ─► megatron_convert (fused qkv, fused gate/up) ─► this rank's TP part
            ─► DistributedDataParallel ─► get_megatron_optimizer(use_distributed_optimizer=True)
    step:   samples ─► (TP > 1: the union of the TP group's samples) ─► micro-batches by tokens
            ─► forward [B, L, V] ─► response log-probs [B, T] ─► loss (policies.losses, the
               torch backend's token-mean weighting) ─► backward into fp32 main grads
            ─► finish_grad_sync (DP sum) ─► clip + Adam on fp32 main params ─► version += 1
    push:   named_weights(): Megatron params ─► HF names (this rank's slices, shard_specs();
            actors.backends.megatron_state, with save / load)
    MTP:    model.mtp_layers 1: megatron-core's own MTP block, its loss injected into the same
            backward, its weights under the spec's mtp.0.* names (actors.backends.megatron_mtp)

Megatron-core's models need CUDA (its rotary embedding, default masks and
optimizer allocate on ``torch.cuda.current_device()``), so this backend runs on
``trainer.device=cuda`` only; :mod:`actors.backends.megatron_convert` (the layout
maps) is pure torch and tested on CPU.

Parallelism: ``torch.distributed`` is initialised here (one process, NCCL) when
it is not already; Megatron's ``parallel_state`` likewise, with
``tensor_parallel_size`` ranks per model and the rest data parallel. Every rank
of a tensor-parallel group trains on the union of its members' samples (one
small all_gather_object), data-parallel groups on their own; gradients are
summed over data parallel with each micro-batch weighted by its share of the
global token count, so the update is that of the token mean over all samples.

Checkpoints are the torch backend's files: an HF directory (``config.json`` +
``model.safetensors``), ``optimizer.pt`` in the torch backend's AdamW format
(Adam moments and fp32 main params mapped to HF names) and
``trainer_state.json``, so either backend resumes the other's
(:mod:`actors.backends.megatron_state`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import transformers

from actors.backends import megatron_convert as mc
from actors.backends.base import Loss, TrainerBackend
from actors.backends.batching import batch_error, micro_batch_budget, micro_batches
from actors.backends.config import TrainerConfig
from actors.backends.loss_pass import accumulate_passes, padded_batch, response_logprobs
from actors.backends.megatron_mtp import MegatronMtp, mtp_block_spec, mtp_unsupported
from actors.backends.megatron_state import ADAM_EPS, DTYPES, MegatronState
from actors.backends.mixed_precision import MainParamsOptimizer
from actors.backends.mtp_weights import mtp_state
from actors.models import load_causal_lm, resolve_model_path
from contracts.sample import Sample
from contracts.weights import ShardSpec

_DEFAULTS = TrainerConfig()  # the one set of defaults: the config's


class MegatronBackend(MegatronState, TrainerBackend):
    """Trains a Megatron-core GPT model converted from a local HF checkpoint.

    Keyword defaults are the ``trainer`` section's, as for the torch backend.
    ``tensor_parallel_size``: ranks each model is split over (>= 1; it must
    divide the world size and the model's key/value heads and FFN width).
    ``distributed_optimizer``: Megatron's distributed optimizer over
    Megatron's DDP (default); ``False``: a plain ``torch.optim.AdamW`` over fp32
    main params (:class:`~actors.backends.mixed_precision.MainParamsOptimizer`
    for bf16), one process and TP 1 only. ``master_dtype`` must be float32 when
    ``dtype`` is bfloat16: Megatron's mixed precision always keeps fp32 main params.
    """

    def __init__(
        self,
        model_path: str,
        *,
        loss: Loss,
        device: str = "cuda",
        dtype: str = _DEFAULTS.dtype,
        lr: float = _DEFAULTS.lr,
        weight_decay: float = _DEFAULTS.weight_decay,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = _DEFAULTS.grad_clip,
        seed: int = 0,
        micro_batch_tokens: int | None = _DEFAULTS.micro_batch_tokens,
        master_dtype: str | None = _DEFAULTS.master_dtype,
        tensor_parallel_size: int = _DEFAULTS.tensor_parallel_size,
        distributed_optimizer: bool = True,
        mtp_layers: int = 0,
        mtp_loss_weight: float = _DEFAULTS.mtp_loss_weight,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if dtype == "bfloat16" and master_dtype != "float32":
            raise ValueError(f"master_dtype: the megatron backend keeps fp32 main params under bfloat16 "
                             f"(Megatron's mixed precision); got {master_dtype!r}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0, got {grad_clip}")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if not callable(loss) or not hasattr(loss, "needs_proximal"):
            raise TypeError(f"loss must be a Loss (policies.losses.make_loss(name, **options)), got {loss!r}")
        if (why := mtp_unsupported(mtp_layers)) is not None:
            raise ValueError(why)
        self.mtp_layers, self.mtp_loss_weight = mtp_layers, mtp_loss_weight
        self._mtp: MegatronMtp | None = None  # mtp_layers > 0, from setup()
        self.model_path, self.loss, self.seed = model_path, loss, seed
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.mixed = self.dtype != torch.float32  # fp32 main params in the optimizer
        self.lr, self.weight_decay, self.betas, self.grad_clip = lr, weight_decay, tuple(betas), grad_clip
        self.micro_batch_tokens = micro_batch_budget(micro_batch_tokens, self.device)
        self.tp_size = tensor_parallel_size
        self.use_distributed_optimizer = distributed_optimizer
        self._version = 0
        self._adam_steps = 0  # optimizer steps the Adam state has taken (its bias correction's t)
        self.model: torch.nn.Module | None = None  # the Megatron GPTModel (unwrapped)
        self.ddp: torch.nn.Module | None = None  # its DistributedDataParallel wrapper (distributed optimizer only)
        self.optimizer: Any = None
        self.shape: mc.GptShape | None = None
        self.world_size, self.rank = 1, 0
        self.tp_rank, self.dp_rank, self.dp_size = 0, 0, 1
        self._specs: dict[str, ShardSpec] = {}

    @classmethod
    def from_config(cls, cfg: TrainerConfig, model_path: str, *, seed: int, loss: Loss,
                    mtp_layers: int = 0) -> MegatronBackend:
        """The backend the ``trainer`` section describes (``backend: megatron``: :mod:`actors.backends.registry`),
        with ``mtp_layers`` MTP modules (``model.mtp_layers``)."""
        if mtp_layers and cfg.mtp_detach:
            raise ValueError("trainer.mtp_detach: true needs backend: torch (megatron-core's MTP block trains the "
                             "shared embedding and head); set trainer.mtp_detach: false")
        return cls(model_path, loss=loss, device=cfg.device, dtype=cfg.dtype, master_dtype=cfg.master_dtype,
                   lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, seed=seed,
                   micro_batch_tokens=cfg.micro_batch_tokens, tensor_parallel_size=cfg.tensor_parallel_size,
                   mtp_layers=mtp_layers, mtp_loss_weight=cfg.mtp_loss_weight)

    # -- setup ---------------------------------------------------------------------

    def setup(self) -> None:
        """Initialise torch.distributed / Megatron's parallel state when needed, build
        the model from the HF checkpoint, wrap it and build the optimizer."""
        model_dir = resolve_model_path(self.model_path)
        self.model_dir = model_dir
        self.hf_config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        self.shape = dataclasses.replace(mc.GptShape.from_hf_config(self.hf_config), mtp_layers=self.mtp_layers)
        self.shape.check_tp(self.tp_size)
        self._init_device()
        self._init_parallel()
        self.model = self._build_model()
        live = dict(self.model.named_parameters())
        if any(".mtp_model_layer." in n for n in live):  # megatron-core >= 0.19's name for it
            self.shape = dataclasses.replace(self.shape, mtp_layer_attr="mtp_model_layer")
        expected = mc.megatron_names(self.shape)
        if sorted(live) != sorted(expected):
            raise RuntimeError(f"megatron-core's GPTModel has parameters {sorted(set(live) - set(expected))} the "
                               f"converter does not know and lacks {sorted(set(expected) - set(live))}")
        hf = self._read_hf_weights(model_dir)
        if self.mtp_layers:  # the checkpoint's modules, or the spec's start (actors.backends.mtp_weights)
            hf.update(mtp_state(hf, hf, self.mtp_layers, self.shape.num_layers, where=f"model {str(model_dir)!r}"))
            self._mtp = MegatronMtp(self.model, self.mtp_layers, self.shape.vocab_size, self.tp_group, self.tp_size)
        self._copy_in(mc.hf_to_megatron(hf, self.shape))
        self._build_optimizer()
        self.pad_id = self.hf_config.pad_token_id if self.hf_config.pad_token_id is not None else 0
        self._metric_keys = self._loss_metric_keys()
        if self.world_size > 1:
            self._specs = {name: spec for name, (_, spec) in self._local_hf().items()}

    def _init_device(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"trainer.device: the megatron backend runs on CUDA only (megatron-core's models "
                             f"allocate on the current CUDA device); got {str(self.device)!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("the megatron backend needs a CUDA device and torch sees none")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)

    def _init_parallel(self) -> None:
        from megatron.core import parallel_state as mpu  # optional dependency (extra megatron)

        if not dist.is_initialized():  # one process: a group of its own, no rendezvous
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        if self.world_size % self.tp_size:
            raise ValueError(f"tensor_parallel_size={self.tp_size} does not divide the {self.world_size} trainer ranks")
        if mpu.model_parallel_is_initialized():
            if mpu.get_tensor_model_parallel_world_size() != self.tp_size:
                raise RuntimeError(f"megatron's parallel state is already initialised with tensor parallel size "
                                   f"{mpu.get_tensor_model_parallel_world_size()}, this backend wants {self.tp_size}")
        else:
            mpu.initialize_model_parallel(tensor_model_parallel_size=self.tp_size, create_gloo_process_groups=False)
        self.tp_rank, self.tp_group = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_group()
        self.dp_rank, self.dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        self.dp_group = mpu.get_data_parallel_group()
        self._seed_model_parallel_rng()

    def _seed_model_parallel_rng(self) -> None:
        # Megatron forks its CUDA RNG tracker around attention even with dropout 0.
        from megatron.core import tensor_parallel  # optional dependency (extra megatron)

        torch.manual_seed(self.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(self.seed)

    def _build_model(self) -> torch.nn.Module:
        # optional dependency (extra megatron)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        s = self.shape
        config = TransformerConfig(
            num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
            num_attention_heads=s.num_heads, num_query_groups=s.num_query_groups, kv_channels=s.head_dim,
            normalization="RMSNorm", layernorm_epsilon=s.rms_norm_eps,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,  # SwiGLU
            add_bias_linear=False, add_qkv_bias=s.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=self.tp_size, sequence_parallel=False,
            params_dtype=self.dtype, pipeline_dtype=self.dtype, bf16=self.dtype == torch.bfloat16,
            attention_softmax_in_fp32=True,
            # every weight is overwritten from the checkpoint
            perform_initialization=False, use_cpu_initialization=self.device.type == "cpu",
            # the fusions need Apex or Transformer Engine; the local spec runs without them
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            # DDP sums data-parallel grads: the loss is already weighted by global tokens
            calculate_per_token_loss=True,
            mtp_num_layers=self.mtp_layers or None, mtp_loss_scaling_factor=self.mtp_loss_weight,
        )
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        model = GPTModel(
            config, layer_spec, mtp_block_spec=mtp_block_spec(config, layer_spec) if self.mtp_layers else None,
            vocab_size=s.padded_vocab_size(self.tp_size), max_sequence_length=s.max_position_embeddings,
            # logits gathered over TP: the log-softmax is the torch backend's (with MTP, megatron-core's
            # MTP loss needs them vocab-parallel: MegatronMtp gathers the main ones)
            parallel_output=bool(self.mtp_layers),
            share_embeddings_and_output_weights=s.tied, position_embedding_type="rope",
            rotary_base=s.rotary_base, rotary_percent=1.0,
        )
        # The local spec's norms are torch.nn.RMSNorm in the default dtype; Megatron's
        # Float16Module casts the whole model the same way.
        return model.to(device=self.device, dtype=self.dtype)

    @staticmethod
    def _read_hf_weights(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
        """Every tensor of an HF checkpoint directory, on the host."""
        single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
        if single.is_file():
            return safetensors.torch.load_file(str(single))
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            out: dict[str, torch.Tensor] = {}
            for name in files:
                out.update(safetensors.torch.load_file(str(model_dir / name)))
            return out
        # pytorch_model.bin: let transformers read it
        return {k: v for k, v in load_causal_lm(model_dir).state_dict().items()}

    @torch.no_grad()
    def _copy_in(self, full: dict[str, torch.Tensor]) -> None:
        """Write full Megatron tensors (this rank's TP part of each) into the model."""
        for name, p in self.model.named_parameters():
            part = mc.tp_shard(name, full[name], self.shape, self.tp_rank, self.tp_size)
            if tuple(part.shape) != tuple(p.shape):
                raise ValueError(f"{name}: the checkpoint gives shape {tuple(part.shape)}, the model has {tuple(p.shape)}")
            p.copy_(part)

    def _build_optimizer(self) -> None:
        if not self.use_distributed_optimizer:
            if self.world_size > 1:
                raise ValueError("the megatron backend's plain Adam (distributed_optimizer=False) runs in one process only")

            def adamw(params):
                return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=ADAM_EPS,
                                         weight_decay=self.weight_decay)

            self.optimizer = (MainParamsOptimizer(self.model.parameters(), adamw) if self.mixed
                              else adamw(self.model.parameters()))
            return
        # optional dependency (extra megatron)
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=False, overlap_param_gather=False)
        self.ddp = DistributedDataParallel(self.model.config, ddp_config, self.model)
        opt_config = OptimizerConfig(optimizer="adam", lr=self.lr, min_lr=self.lr, weight_decay=self.weight_decay,
                                     adam_beta1=self.betas[0], adam_beta2=self.betas[1], adam_eps=ADAM_EPS,
                                     clip_grad=self.grad_clip, bf16=self.dtype == torch.bfloat16,
                                     params_dtype=self.dtype, use_distributed_optimizer=True)
        # config_overrides={}: one parameter group, weight decay on every parameter as the
        # torch backend's AdamW does (Megatron's default exempts biases and norms).
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp], config_overrides={},
                                                use_gloo_process_groups=False)
        for group in self.optimizer.param_groups:  # no LR scheduler sets them
            group["lr"], group["weight_decay"] = self.lr, self.weight_decay

    def _loss_metric_keys(self) -> list[str]:
        """The metric names the loss reports (data-parallel ranks reduce them in this order)."""
        z = torch.zeros(1, 1)
        _, metrics = self.loss(z, z, torch.zeros(1), torch.ones(1, 1),
                               proximal_logprobs=z if self.loss.needs_proximal else None)
        mtp = [f"mtp/{m}_{k}" for k in range(self.mtp_layers) for m in ("loss", "acc")]
        return ["loss", "entropy", *metrics, *mtp]

    @property
    def version(self) -> int:
        return self._version

    def _require_setup(self) -> None:
        if self.model is None:
            raise RuntimeError("MegatronBackend.setup() must be called before use")
        if self.device.type == "cuda":  # the current device is per thread; Megatron allocates on it
            torch.cuda.set_device(self.device)

    # -- the loss pass (actors.backends.loss_pass) ----------------------------------

    def _logits(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, L, V]`` logits of the real vocabulary (response positions ``pos`` / ``mask``:
        the MTP loss's targets). Causal attention only: with right padding no real token sees
        a pad, so no padding mask is needed."""
        length = ids.shape[1]
        position_ids = torch.arange(length, device=ids.device).unsqueeze(0).expand_as(ids)
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).triu(1)[None, None]  # True: masked
        module = self.ddp if self.ddp is not None else self.model
        if self._mtp is not None:
            return self._mtp.logits(module, ids, pos, mask, position_ids=position_ids, attention_mask=causal)
        logits = module(input_ids=ids, position_ids=position_ids, attention_mask=causal)
        return logits[..., : self.shape.vocab_size]

    def _response_logprobs(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs ``[B, T]`` of each response token (temperature 1), entropy ``[B, T]`` and mask."""
        ids, _, pos, mask = padded_batch(samples, self.pad_id, self.device)
        return response_logprobs(self._logits(ids, pos, mask), ids, pos, mask)

    def _agree(self, error: str | None) -> None:
        """Raise on every rank when any rank's input was refused (before any collective
        that a refusing rank would leave others waiting in)."""
        if self.world_size > 1:
            flag = torch.tensor([float(error is not None)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if error is None and flag.item():
                raise ValueError("another trainer rank refused its part of the batch (its error says why)")
        if error is not None:
            raise ValueError(error)

    def _tp_union(self, *columns: list | None) -> tuple[list, ...]:
        """TP > 1: each column (samples, advantages, ...) as the concatenation of the TP
        group's members' in rank order, and where this rank's rows start. TP = 1: as is."""
        if self.tp_size == 1:
            return (*columns, 0)
        gathered: list[tuple[list[object], ...]] = [()] * self.tp_size  # filled by all_gather_object
        dist.all_gather_object(gathered, columns, group=self.tp_group)
        start = sum(len(g[0]) for g in gathered[: self.tp_rank])
        merged = []
        for c in range(len(columns)):
            parts = [g[c] for g in gathered]
            if any(p is None for p in parts):
                if not all(p is None for p in parts):
                    raise RuntimeError("proximal_logprobs passed on some trainer ranks and not on others")
                merged.append(None)
            else:
                merged.append([x for p in parts for x in p])
        return (*merged, start)

    def _dp_sum(self, values: list[float]) -> list[float]:
        if self.dp_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    # -- endpoints -----------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per-response-token log-probs under the current weights (temperature 1). With
        more than one rank every rank calls it at once, each with its own samples."""
        self._require_setup()
        mine = list(samples)
        self._agree(batch_error(mine))
        union, start = self._tp_union(mine)
        if not union:
            return []
        out: list[list[float]] = [[] for _ in union]
        for idx in micro_batches(union, self.micro_batch_tokens):
            part = [union[i] for i in idx]
            logprobs, _, _ = self._response_logprobs(part)
            rows = logprobs.cpu()
            for row, i in enumerate(idx):
                out[i] = rows[row, : len(union[i].response_ids)].tolist()
        return out[start : start + len(mine)]

    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[float],
        proximal_logprobs: list[list[float]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on the batch with the configured loss; raises ``version`` by 1.
        Same contract as the torch backend's: ``advantages[i]`` belongs to ``samples[i]``;
        ``proximal_logprobs`` for a loss that needs them, else recomputed here."""
        self._require_setup()
        samples, advantages = list(samples), list(advantages)
        self._agree(batch_error(samples, advantages, proximal_logprobs))
        samples, advantages, proximal_logprobs, _ = self._tp_union(samples, advantages, proximal_logprobs)
        total_tokens, total_samples = self._dp_sum([float(sum(len(s.response_ids) for s in samples)),
                                                    float(len(samples))])
        if not total_samples:
            raise ValueError("empty batch")
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        passes = micro_batches(samples, self.micro_batch_tokens) if samples else []
        if self._mtp is not None:  # its loss: a sum over response tokens, / the global batch's
            self._mtp.set_scale(1.0 / max(total_tokens, 1.0))
        sums = accumulate_passes(self.loss, self._response_logprobs, samples, advantages, proximal_logprobs,
                                 passes, total_tokens, dict.fromkeys(self._metric_keys, 0.0),
                                 aux=self._mtp and self._mtp.take)
        sums = dict(zip(sums, self._dp_sum(list(sums.values()))))
        grad_norm = self._step()
        self._version += 1
        self._adam_steps += 1
        return {**sums, "grad_norm": float(grad_norm), "tokens": float(total_tokens), "version": float(self._version)}

    def _step(self) -> float:
        """Reduce the grads, clip on the global norm, step; returns the norm before clipping."""
        if self.ddp is None:
            if isinstance(self.optimizer, MainParamsOptimizer):
                return float(self.optimizer.clip_and_step(self.grad_clip))
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            return float(norm)
        self.ddp.finish_grad_sync()
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"megatron's optimizer skipped the step (grad norm {grad_norm}: inf or nan grads)")
        return float(grad_norm)
