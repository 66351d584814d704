"""The plain-PyTorch trainer backend: one HF causal LM, AdamW (or Muon + AdamW), an injected loss.

Every method is synchronous and blocking; the trainer actor calls them on its
worker thread so the event loop never waits on a matmul.

    samples ─► packed: one row [1, sum of lengths], attention within each sequence
               (actors.backends.packing); padded (trainer.packed=false): [B, T], right-padded
            ─► forward ─► log-probs of the response tokens [B, T_resp]
               (packed: the LM head in chunks of response tokens, actors.backends.chunked_logprobs)
            ─► loss(logprobs, rollout_logprobs, advantages, mask) ─► optimizer step (actors.backends.optimizers)
            ─► metrics and grad norm read back in one transfer, the step's only sync
            ─► version += 1 ─► named_weights() for the weight sync

Data parallel (FSDP2) when ``torch.distributed`` is initialised with world size
N > 1 before :meth:`TorchBackend.setup` (the trainer actor does it: gloo on CPU,
NCCL on GPU after ``torch.cuda.set_device``). Every rank loads the same
checkpoint, then each decoder layer and the root are ``fully_shard``-ed over the
default group (dim 0 of every parameter, uneven like ``torch.chunk``)::

    rank r: its own samples ─► micro-batches, weighted by tokens / GLOBAL tokens
            (padded with weight-0 passes to the ranks' max pass count, since every
            forward/backward all-gathers and reduce-scatters)
        ─► grads reduce-scattered as a SUM ─► clip on the full norm ─► AdamW on the shard
           (Muon: on the full matrix, gathered; this rank's rows kept)
        ─► named_weights(): this rank's shards, shard_specs(): where they sit

The update equals one worker's on the union of the ranks' samples (up to fp32
reduction order). Checkpoints are the same files whatever the world size.

``trainer.compile`` (one worker): each decoder layer and the final norm run
``torch.compile``-d, the packed attention an opaque op inside them
(:mod:`actors.backends.compile`); ``compile_s`` / ``compiled_graphs`` say what
compiling cost, also in every step's metrics. ``trainer.kernels: liger``: the model's
RMSNorm, SwiGLU MLP and RoPE run Liger-Kernel's fused Triton kernels
(:mod:`actors.backends.kernels`), and the chunked head's softmax ours
(:mod:`actors.backends.head_kernels`). ``mtp_layers`` > 0 (``model.mtp_layers``): MTP modules on
the model, trained by an auxiliary loss inside the same forward and backward (:mod:`actors.backends.mtp`).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from collections.abc import Iterator

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from actors.backends.activation_checkpointing import enable_activation_checkpointing
from actors.backends.base import Loss, TrainerBackend, check_checkpoint, read_trainer_version, write_trainer_state
from actors.backends.batching import batch_error, micro_batch_budget, micro_batches
from actors.backends.chunked_logprobs import chunked_logprobs
from actors.backends.compile import (PACKED_COMPILED_ATTENTION, CompileWatch, compile_context, compile_model,
                                     compiled_attention_kwargs)
from actors.backends.config import MuonConfig, TrainerConfig
from actors.backends.graphs import GraphedPasses, graphs_unsupported
from actors.backends.kernels import KERNELS, apply_kernels, kernels_scope
from actors.backends.loss_pass import padded_batch, response_logprobs, run_passes
from actors.backends.mixed_precision import MainParamsOptimizer
from actors.backends.mtp import MtpRunner, attach_mtp
from actors.backends.optimizers import build_optimizer
from actors.backends.packing import PACKED_ATTENTION, PackedBatch, packed_batch, packing_unsupported
from actors.backends.torch_fsdp import live_tensors, load_sharded, local_shard, save_sharded, shard_model, shard_spec
from actors.models import load_causal_lm, resolve_model_path
from contracts.sample import Sample
from contracts.weights import ShardSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULTS = TrainerConfig()  # the one set of defaults: the config's
_log = logging.getLogger(__name__)


class TorchBackend(TrainerBackend):
    """Trains a local HF causal LM with one optimizer step per batch.

    Runs build it with :func:`actors.backends.make_backend` from their
    ``trainer`` section; the keyword defaults here are that section's
    (:class:`~actors.backends.config.TrainerConfig`), for direct use in tests.
    ``loss``: the loss to train with, options bound
    (``policies.losses.make_loss("ppo_clip", clip_eps_low=0.2)``).
    ``version`` counts optimizer steps since the loaded checkpoint (0 at
    start); it is the weight version rollouts are stamped with.

    Data parallel over the default ``torch.distributed`` group when one with
    more than one rank exists at :meth:`setup` (see the module docstring):
    every rank must then call :meth:`setup`, :meth:`compute_logprobs`,
    :meth:`train_step` and :meth:`save` together, each with its own samples.
    """

    def __init__(
        self,
        model_path: str,
        *,
        loss: Loss,
        device: str = _DEFAULTS.device,
        dtype: str = _DEFAULTS.dtype,
        lr: float = _DEFAULTS.lr,
        weight_decay: float = _DEFAULTS.weight_decay,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = _DEFAULTS.grad_clip,
        seed: int = 0,
        micro_batch_tokens: int | None = _DEFAULTS.micro_batch_tokens,
        master_dtype: str | None = _DEFAULTS.master_dtype,
        activation_checkpointing: bool = _DEFAULTS.activation_checkpointing,
        packed: bool = _DEFAULTS.packed,
        logprob_chunk_tokens: int = _DEFAULTS.logprob_chunk_tokens,
        compile: bool = _DEFAULTS.compile,
        kernels: str = _DEFAULTS.kernels,
        cuda_graphs: bool = _DEFAULTS.cuda_graphs,
        muon: MuonConfig | None = None, mtp_layers: int = 0, mtp_lr: float | None = None,  # mtp_lr None: lr
        mtp_loss_weight: float = _DEFAULTS.mtp_loss_weight, mtp_detach: bool = _DEFAULTS.mtp_detach,
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {list(KERNELS)}, got {kernels!r}")
        if master_dtype is not None and master_dtype not in _DTYPES:
            raise ValueError(f"master_dtype must be one of {sorted(_DTYPES)} or None, got {master_dtype!r}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if (mtp_layers < 0 or mtp_loss_weight < 0 or mtp_layers and (compile or cuda_graphs)
                or mtp_lr is not None and (mtp_lr <= 0 or not mtp_layers)):
            raise ValueError(f"mtp_layers {mtp_layers}, mtp_loss_weight {mtp_loss_weight}: >= 0; mtp_lr {mtp_lr}: > 0, only "
                             f"with mtp_layers > 0; MTP not with compile or cuda_graphs (its hooks run outside graphs)")
        self.mtp_layers, self.mtp_loss_weight, self.mtp_detach, self.mtp_lr = mtp_layers, mtp_loss_weight, mtp_detach, mtp_lr
        self._mtp: MtpRunner | None = None  # mtp_layers > 0, from setup()
        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        # Optimizer params in this dtype when the model's is lower (Megatron-style
        # fp32 main params; see mixed_precision.py). None: step the model params as they are.
        self.master_dtype = None if master_dtype is None or _DTYPES[master_dtype] == self.dtype else _DTYPES[master_dtype]
        self.lr, self.weight_decay, self.betas, self.grad_clip = lr, weight_decay, tuple(betas), grad_clip
        self.muon = muon  # None: AdamW over every param; else trainer.muon (actors.backends.optimizers)
        if not callable(loss) or not hasattr(loss, "needs_proximal"):
            raise TypeError(f"loss must be a Loss (policies.losses.make_loss(name, **options)), got {loss!r}")
        self.loss = loss
        # Tokens per forward (packed: their sum; padded: rows x longest row); 0 = the whole batch at once.
        self.micro_batch_tokens = micro_batch_budget(micro_batch_tokens, self.device)
        self.activation_checkpointing = activation_checkpointing
        if logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens must be >= 1, got {logprob_chunk_tokens}")
        # packed: what was asked for until setup(), then what runs (padded_reason says why not)
        self.packed, self.logprob_chunk_tokens = packed, logprob_chunk_tokens
        self.padded_reason: str | None = None
        self.compile, self.kernels, self.cuda_graphs = compile, kernels, cuda_graphs
        self._graphs: GraphedPasses | None = None  # cuda_graphs, from setup()
        self._compile_watch = CompileWatch()
        self.seed = seed
        self._version = 0
        self.model = None
        self.optimizer = None
        self.world_size, self.rank = 1, 0  # the data-parallel group's, read at setup()
        self._specs: dict[str, ShardSpec] = {}  # world > 1: which slice named_weights() holds
        self._live: dict[str, torch.Tensor] | None = None  # one worker: named_weights(), listed once

    # -- setup -----------------------------------------------------------------

    def setup(self) -> None:
        """Load the model and build the optimizer (heavy; call once, off the loop).
        With a ``torch.distributed`` group of world size > 1 initialised, every
        rank calls it, and the model and optimizer state are sharded (FSDP2)."""
        torch.manual_seed(self.seed)
        self._live = None
        model_dir = resolve_model_path(self.model_path)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        if self.compile and self.world_size > 1:
            raise ValueError(f"trainer.compile: not with {self.world_size} data-parallel ranks (FSDP2); "
                             f"one worker only")
        # Sharded, the params are the optimizer's own, in master_dtype when the
        # model's dtype is lower (see _shard_model): no MainParamsOptimizer then.
        load_dtype = (self.master_dtype or self.dtype) if self.world_size > 1 else self.dtype
        self.model = load_causal_lm(model_dir, device=self.device, dtype=load_dtype)
        # No dropout in RL: the log-probs we train on must match the sampler's.
        self.model.eval()
        if self.mtp_layers:
            attach_mtp(self.model, self.mtp_layers, model_dir)
            self._mtp = MtpRunner(self.model, self.mtp_loss_weight, self.logprob_chunk_tokens, self.kernels == "liger",
                                  detach=self.mtp_detach)
        if self.packed:
            self._enable_packing()
        apply_kernels(self.model, self.kernels)
        if self.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        if self.compile:
            compile_model(self.model)
        if self.cuda_graphs and self.padded_reason is not None:  # graphs need packing, which fell back as it does
            _log.warning("trainer.cuda_graphs: off, as this model trains padded (%s)", self.padded_reason)
        elif self.cuda_graphs:
            if (reason := graphs_unsupported(self.device, self.dtype, packed=self.packed, compile=self.compile,
                                             activation_checkpointing=self.activation_checkpointing,
                                             world_size=self.world_size)) is not None:
                raise ValueError(f"trainer.cuda_graphs: {reason}")
            self._graphs = GraphedPasses(self.model, self._packed_forward, self.device)

        if self.world_size > 1:
            self._shard_model()
        # AdamW fused on one GPU: one kernel for every param (sharded DTensors keep foreach)
        self.optimizer = build_optimizer(self.model, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay,
                                         muon=self.muon, fused=self.device.type == "cuda" and self.world_size == 1,
                                         sharded=self.world_size > 1,
                                         master_dtype=self.master_dtype if self.world_size == 1 else None, mtp_lr=self.mtp_lr)
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0

    def _shard_model(self) -> None:
        """FSDP2 over the default group (``torch_fsdp.shard_model``); records each tensor's :class:`ShardSpec`."""
        shard_model(self.model, self.device.type, self.world_size, self.dtype, self.master_dtype)
        self._specs = {name: shard_spec(t, self.rank, self.world_size) for name, t, _ in live_tensors(self.model)}

    @property
    def version(self) -> int:
        return self._version

    @property
    def compile_s(self) -> float:
        """``trainer.compile``: wall seconds of the calls that compiled (0 until the first forward)."""
        return self._compile_watch.seconds

    @property
    def compiled_graphs(self) -> int:
        """``trainer.compile``: graphs compiled so far (a count that grows after warm-up is a recompilation)."""
        return self._compile_watch.graphs

    def _require_setup(self) -> None:
        if self.model is None:
            raise RuntimeError("TorchBackend.setup() must be called before use")

    # -- the loss pass (actors.backends.loss_pass) ---------------------------------

    def _response_logprobs(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs ``[B, T]`` of each response token (T=1), entropy ``[B, T]`` and mask."""
        if self.packed:
            return self._packed_logprobs(samples)
        ids, attn, pos, mask = padded_batch(samples, self.pad_id, self.device)
        if self._mtp is not None:
            self._mtp.arm(samples, [i * ids.shape[1] for i in range(len(samples))])
        with self._compiled():
            logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits  # [B, L, V]
        return response_logprobs(logits, ids, pos, mask)

    def _packed_logprobs(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_response_logprobs` on one packed row. Entropy only where gradients are on
        (a training forward; zeros otherwise: nobody reads it)."""
        if self._graphs is not None and torch.is_grad_enabled():
            return self._graphs.logprobs(samples)
        batch = packed_batch(samples, self.device)
        if self._mtp is not None:
            self._mtp.arm(samples, batch.seq_bounds[: len(samples)])
        out = self._packed_forward(batch, batch.pred_positions, batch.targets, torch.is_grad_enabled())
        logprobs, entropy = batch.scatter(out).unbind(-1)  # [B, T_max] each
        return logprobs, entropy, batch.mask

    def _packed_forward(self, batch: PackedBatch, positions: torch.Tensor, targets: torch.Tensor,
                        with_entropy: bool) -> torch.Tensor:
        """The model on a packed row: ``[T, 2]``, the log-prob of ``targets`` from the hidden
        states at ``positions``, and the entropy there (zeros without ``with_entropy``)."""
        attention = compiled_attention_kwargs(batch) if self.compile else batch.attention_kwargs()
        with self._head_gives_logprobs(positions, targets, with_entropy), self._compiled():
            return self.model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                              **attention).logits[0]

    @contextlib.contextmanager
    def _head_gives_logprobs(self, positions: torch.Tensor, targets: torch.Tensor,
                             with_entropy: bool) -> Iterator[None]:
        """While open, the LM head returns ``[1, T, 2]``: each target's log-prob and the entropy,
        from :func:`chunked_logprobs`, instead of logits. It runs inside the model's own forward,
        so FSDP2 has gathered its weight (tied or not) and reduces its gradient as any other's;
        it takes the hidden states at ``positions`` (those that predict a response token) only,
        by ``index_select``, whose backward is one index add (``logits_to_keep`` would index,
        and its backward sorts the positions first)."""
        head = self.model.get_output_embeddings()

        def forward(hidden: torch.Tensor) -> torch.Tensor:  # [1, N, H]
            logprobs, entropy = chunked_logprobs(hidden[0].index_select(0, positions), head.weight, head.bias,
                                                 targets, self.logprob_chunk_tokens, with_entropy=with_entropy,
                                                 fused=self.kernels == "liger")
            entropy = entropy if with_entropy else torch.zeros_like(logprobs)
            return torch.stack([logprobs[None], entropy[None]], dim=-1)  # a new tensor, not a view: FSDP2 hooks it

        head.forward = forward
        try:
            yield
        finally:
            del head.forward  # the class's forward again

    def _compiled(self) -> contextlib.AbstractContextManager:
        """Where the model's forward runs: as it is, or under ``trainer.compile``'s dynamo settings."""
        return compile_context(self.activation_checkpointing) if self.compile else contextlib.nullcontext()

    def _enable_packing(self) -> None:
        """Run the model on packed rows (:mod:`actors.backends.packing`), or padded when it
        cannot, saying why once. Compiled, the attention is the same behind a custom op."""
        reason = packing_unsupported(self.model)
        attention = PACKED_COMPILED_ATTENTION if self.compile else PACKED_ATTENTION
        if reason is None:
            self.model.set_attn_implementation(attention)
            if self.model.config._attn_implementation != attention:
                kept = self.model.config._attn_implementation
                reason = f"{type(self.model).__name__} kept attn_implementation={kept!r}"
        if reason is not None:
            self.packed, self.padded_reason = False, reason
            _log.warning("trainer.packed: %s; this model trains padded", reason)

    # -- endpoints -----------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token log-probs under the current weights (temperature 1).
        Data parallel: every rank calls it at once with its own samples (none is
        fine there: the rank still joins the forward's all-gathers)."""
        self._require_setup()
        with self._compile_watch("compute_logprobs"), kernels_scope(self.kernels):
            return self._compute_logprobs(samples)

    def _compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        if self.world_size > 1:
            self._agree(batch_error(samples), [])
            # one forward on every rank, a filler row where a rank has no samples
            logprobs, _, _ = self._response_logprobs(samples or [self._filler()])
            self.model.reshard()  # the root keeps its params gathered after a forward
        else:
            logprobs, _, _ = self._response_logprobs(samples)
        rows = logprobs[: len(samples)].tolist()  # one transfer for the batch
        return [row[: len(s.response_ids)] for row, s in zip(rows, samples)]

    def train_step(
        self,
        samples: list[Sample],
        advantages: list[float],
        proximal_logprobs: list[list[float]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on the batch with the configured loss; raises ``version`` by 1.

        ``advantages[i]`` belongs to ``samples[i]`` and applies to all its
        response tokens; each sample's ``rollout_logprobs`` are the behaviour
        log-probs (one per response token). For a loss that needs proximal
        log-probs (``decoupled_ppo``) pass what :meth:`compute_logprobs`
        returned for this batch, or leave ``None`` and they are recomputed
        here from the current weights (one extra forward pass).
        """
        self._require_setup()
        with self._compile_watch("train_step"), kernels_scope(self.kernels):
            metrics = self._train_step(samples, advantages, proximal_logprobs)
        if self.compile:  # cumulative: a figure that grows after warm-up is a recompilation
            metrics.update(compile_s=self.compile_s, compiled_graphs=float(self.compiled_graphs))
        if self._graphs is not None:  # cumulative, as compile's: a new bucket captures its graphs
            metrics.update(graph_capture_s=self._graphs.capture_s, cuda_graphs=float(len(self._graphs.graphs)),
                           cuda_graph_reuses=float(self._graphs.reuses))
        return metrics

    def _train_step(self, samples: list[Sample], advantages: list[float],
                    proximal_logprobs: list[list[float]] | None) -> dict[str, float]:
        passes, total_tokens = self._plan_passes(samples, advantages, proximal_logprobs)
        self.optimizer.zero_grad(set_to_none=True)
        if self._graphs is not None:  # the graphs' backwards add into these very tensors
            self._graphs.attach_grads()
        # a None pass is a weight-0 one on the filler row: its collectives match a busier rank's
        metrics = run_passes(self.loss, self._response_logprobs, samples, advantages, proximal_logprobs,
                             passes, total_tokens, filler=self._filler(), aux=self._mtp and self._mtp.take)
        if self.world_size > 1:  # the ranks' token-weighted sums add up to the batch's means
            sums = metrics.read()
            totals = torch.tensor(list(sums.values()), dtype=torch.float64, device=self.device)
            dist.all_reduce(totals)
            sums = dict(zip(sums, totals.tolist()))
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        if isinstance(self.optimizer, MainParamsOptimizer):
            grad_norm = self.optimizer.clip_and_step(max_norm)
        elif self.world_size > 1:
            grads = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
            if isinstance(grad_norm, DTensor):  # the shards' partial norms, combined: the full grad's
                grad_norm = grad_norm.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, grad_norm)
            self.optimizer.step()
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            self.optimizer.step()
        self._version += 1
        counts = {"tokens": float(total_tokens), "version": float(self._version)}
        if self.world_size > 1:
            return {**sums, "grad_norm": float(grad_norm), **counts}
        # the step's one device-to-host transfer, once everything is launched
        return {**metrics.read(grad_norm=grad_norm), **counts}

    def _plan_passes(self, samples: list[Sample], advantages: list[float],
                     proximal_logprobs: list[list[float]] | None) -> tuple[list[list[int] | None], int]:
        """The micro-batches (sample indices) this rank runs, ``None`` for a
        weight-0 pass, and the token count the weights divide by. Data parallel:
        the whole batch's, and as many passes as the busiest rank's, since every
        forward and backward runs FSDP's collectives on every rank."""
        if self.world_size == 1:
            if len(advantages) != len(samples):
                raise ValueError(f"got {len(advantages)} advantages for {len(samples)} samples")
            if proximal_logprobs is not None and len(proximal_logprobs) != len(samples):
                raise ValueError(f"got proximal_logprobs for {len(proximal_logprobs)} samples, expected {len(samples)}")
            passes = micro_batches(samples, self.micro_batch_tokens, packed=self.packed)
            return passes, sum(len(s.response_ids) for s in samples)
        local = micro_batches(samples, self.micro_batch_tokens, packed=self.packed) if samples else []
        recompute = self.loss.needs_proximal and proximal_logprobs is None  # an extra forward per pass
        table = self._agree(batch_error(samples, advantages, proximal_logprobs),
                            [sum(len(s.response_ids) for s in samples), len(samples), len(local), float(recompute)])
        if table[:, 1].sum() == 0:
            raise ValueError("empty batch")
        if table[:, 3].min() != table[:, 3].max():
            raise RuntimeError("proximal_logprobs passed on some trainer ranks and not on others: pass them on all or none")
        return local + [None] * (int(table[:, 2].max()) - len(local)), int(table[:, 0].sum())

    def _agree(self, error: str | None, values: list[float]) -> torch.Tensor:
        """Data parallel: every rank's ``values`` as ``[world, len(values)]``
        (one small all_gather). Raises on every rank when any rank's input was
        refused, so no rank is left waiting in a collective for it."""
        mine = torch.tensor([float(error is not None), *values], dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu()
        if error is not None:
            raise ValueError(error)
        refused = [r for r in range(self.world_size) if table[r, 0]]
        if refused:
            raise ValueError(f"trainer rank(s) {refused} refused their part of the batch (their errors say why)")
        return table[:, 1:]

    def _filler(self) -> Sample:
        """The one-token row of a rank's weight-0 passes (advantage 0, log-probs 0:
        finite, so its zero-weighted gradient is exactly zero)."""
        return Sample(uid="<filler>", group_id="<filler>", prompt_ids=[self.pad_id],
                      response_ids=[self.pad_id], rollout_logprobs=[0.0])

    def named_weights(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer under its HF name, detached.

        Tied weights appear under each of their names (``lm_head.weight`` as
        well as ``model.embed_tokens.weight``) as ``state_dict()`` lists them,
        so a receiver can match names one to one. ``dtype`` converts (a copy);
        ``None`` returns the live tensors without copying — do not modify them.

        Data parallel: this rank's shards (what :meth:`shard_specs` describes),
        a tied name the same tensor as its first name; live, they are the
        optimizer's params (fp32 when the model dtype is bf16 with fp32 main
        params: a sync casts them to the engines' dtype, the rounding the
        forward computes with).
        """
        self._require_setup()
        if isinstance(dtype, str):
            dtype = _DTYPES[dtype]
        out = {}
        if self.world_size > 1:
            for name, t, tied in live_tensors(self.model):
                local = out[tied] if tied is not None else local_shard(t, self._specs[name])
                if tied is None and dtype is not None and local.is_floating_point():
                    local = local.to(dtype)
                out[name] = local
            return out
        if self._live is None:  # the same tensors every step (written in place): listed once
            self._live = {name: t.detach() for name, t in self.model.state_dict(keep_vars=False).items()}
        if dtype is None:
            return dict(self._live)
        return {name: t.to(dtype) if t.is_floating_point() else t for name, t in self._live.items()}

    def shard_specs(self) -> dict[str, ShardSpec] | None:
        """Data parallel: which dim-0 slice of each full tensor :meth:`named_weights`
        holds on this rank (possibly empty); ``None`` when unsharded."""
        return dict(self._specs) if self.world_size > 1 else None

    # -- checkpoints -------------------------------------------------------------

    def save(self, directory: str | pathlib.Path) -> None:
        """Write an HF-loadable checkpoint (config + safetensors), the optimizer
        state (``optimizer.pt``) and ``trainer_state.json`` (version) into ``directory``."""
        self._require_setup()
        path = pathlib.Path(directory)
        if self.world_size > 1:
            return save_sharded(self.model, self.optimizer, path, rank=self.rank, dtype=self.dtype,
                                master_dtype=self.master_dtype, version=self._version, loss=self.loss)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        write_trainer_state(path, self._version, self.loss)

    def load(self, directory: str | pathlib.Path) -> None:
        """Restore weights, optimizer state and version written by :meth:`save`."""
        self._require_setup()
        path = pathlib.Path(directory)
        check_checkpoint(path)
        if self.world_size > 1:
            load_sharded(self.model, self.optimizer, path, specs=self._specs, master_dtype=self.master_dtype)
            self._version = read_trainer_version(path)
            return
        state = safetensors.torch.load_file(str(path / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # A tied lm_head is saved once, under the embedding's name.
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"checkpoint {str(path)!r} does not match the model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True))
        self._version = read_trainer_version(path)
