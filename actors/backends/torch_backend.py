"""The plain-PyTorch trainer backend: one HF causal LM, AdamW, an injected loss.

Every method is synchronous and blocking; the trainer actor calls them on its
worker thread so the event loop never waits on a matmul.

    samples ─► pad to [B, T] (prompt + response, right-padded)
            ─► forward ─► log-probs of the response tokens [B, T_resp]
            ─► loss(logprobs, rollout_logprobs, advantages, mask) ─► AdamW step
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
        ─► named_weights(): this rank's shards, shard_specs(): where they sit

The update equals one worker's on the union of the ranks' samples (up to fp32
reduction order). Checkpoints are the same files whatever the world size.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from actors.backends.base import Loss, TrainerBackend
from actors.backends.batching import batch_error, micro_batch_budget, micro_batches, pad_values
from actors.backends.config import TrainerConfig
from actors.backends.mixed_precision import MainParamsOptimizer
from actors.models import load_causal_lm, resolve_model_path
from contracts.sample import Sample
from contracts.weights import ShardSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULTS = TrainerConfig()  # the one set of defaults: the config's


def _shard_spec(t: torch.Tensor, rank: int, world_size: int) -> ShardSpec:
    """The slice of ``t``'s full tensor that ``rank`` holds: FSDP2 splits dim 0
    like ``torch.chunk`` (ceil-sized chunks, the last ranks' shorter or empty).
    A tensor FSDP does not shard (a buffer) is rank 0's whole and others' empty."""
    full_shape = tuple(t.shape)
    if not full_shape:
        raise ValueError("a 0-dim weight cannot be described by a ShardSpec")
    rows = full_shape[0]
    if isinstance(t, DTensor):
        assert tuple(t.placements) == (Shard(0),), t.placements
        chunk = -(-rows // world_size)
        offset = min(rank * chunk, rows)
        length = min(chunk, rows - offset)
        assert t.to_local().shape[0] == length, (full_shape, rank, t.to_local().shape)
    else:
        offset, length = 0, rows if rank == 0 else 0
    return ShardSpec(full_shape=full_shape, dim=0, offset=offset, length=length)


def _local(t: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The part of live tensor ``t`` that ``spec`` describes, detached (a view)."""
    if isinstance(t, DTensor):
        return t.to_local().detach()
    return t.detach().narrow(0, spec.offset, spec.length)


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
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if master_dtype is not None and master_dtype not in _DTYPES:
            raise ValueError(f"master_dtype must be one of {sorted(_DTYPES)} or None, got {master_dtype!r}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        # Optimizer params in this dtype when the model's is lower (Megatron-style
        # fp32 main params; see mixed_precision.py). None: step the model params as they are.
        self.master_dtype = None if master_dtype is None or _DTYPES[master_dtype] == self.dtype else _DTYPES[master_dtype]
        self.lr, self.weight_decay, self.betas, self.grad_clip = lr, weight_decay, tuple(betas), grad_clip
        if not callable(loss) or not hasattr(loss, "needs_proximal"):
            raise TypeError(f"loss must be a Loss (policies.losses.make_loss(name, **options)), got {loss!r}")
        self.loss = loss
        # Padded tokens (rows x longest row) per forward; 0 = the whole batch at once.
        self.micro_batch_tokens = micro_batch_budget(micro_batch_tokens, self.device)
        self.activation_checkpointing = activation_checkpointing
        self.seed = seed
        self._version = 0
        self.model = None
        self.optimizer = None
        self.world_size, self.rank = 1, 0  # the data-parallel group's, read at setup()
        self._specs: dict[str, ShardSpec] = {}  # world > 1: which slice named_weights() holds

    # -- setup -----------------------------------------------------------------

    def setup(self) -> None:
        """Load the model and build the optimizer (heavy; call once, off the loop).
        With a ``torch.distributed`` group of world size > 1 initialised, every
        rank calls it, and the model and optimizer state are sharded (FSDP2)."""
        torch.manual_seed(self.seed)
        model_dir = resolve_model_path(self.model_path)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        # Sharded, the params are the optimizer's own, in master_dtype when the
        # model's dtype is lower (see _shard_model): no MainParamsOptimizer then.
        load_dtype = (self.master_dtype or self.dtype) if self.world_size > 1 else self.dtype
        self.model = load_causal_lm(model_dir, device=self.device, dtype=load_dtype)
        # No dropout in RL: the log-probs we train on must match the sampler's.
        self.model.eval()
        if self.activation_checkpointing:
            self._enable_activation_checkpointing()
        def adamw(params):  # fused on one GPU: one kernel for every param (sharded DTensors keep foreach)
            fused = self.device.type == "cuda" and self.world_size == 1
            return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay,
                                     fused=fused or None)

        if self.world_size > 1:
            self._shard_model()
            self.optimizer = adamw(self.model.parameters())
        elif self.master_dtype is None:
            self.optimizer = adamw(self.model.parameters())
        else:
            self.optimizer = MainParamsOptimizer(self.model.parameters(), adamw, self.master_dtype)
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0

    def _shard_model(self) -> None:
        """FSDP2 over the default group: each decoder layer, then the root (which
        takes the rest, the tied embedding / lm_head among it, so they stay one
        parameter). Records each tensor's :class:`ShardSpec`."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # Mixed precision is FSDP2's own: the sharded params (what AdamW steps) stay in
        # master_dtype, are cast to the model dtype when all-gathered for compute, and
        # their grads are reduced and accumulated in master_dtype. That is the sharded
        # form of MainParamsOptimizer (fp32 main params, bf16 compute) without keeping
        # a second copy; the engines get the same bf16 rounding of the fp32 params.
        policy = (MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=self.master_dtype)
                  if self.master_dtype is not None else MixedPrecisionPolicy())
        layer_types = set(getattr(self.model, "_no_split_modules", None) or ())  # HF: the decoder layer class
        for module in list(self.model.modules()):
            if type(module).__name__ in layer_types:
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                # Sum, not average: each rank's loss is already scaled by its share of
                # the global token count, so the sum is the whole batch's token mean.
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_gradient_divide_factor(1.0)
                    # a plain SUM, not NCCL's PREMUL_SUM by 1.0, which gloo lacks
                    module.set_force_sum_reduction_for_comms(True)
                else:  # torch < 2.8 (untested here): NCCL only
                    module.set_reduce_scatter_divide_factor(1.0)
        self._specs = {name: _shard_spec(t, self.rank, self.world_size) for name, t, _ in self._live_tensors()}

    def _live_tensors(self) -> list[tuple[str, torch.Tensor, str | None]]:
        """``(name, live tensor, name it is tied to or None)`` for every entry of
        ``state_dict()``, in its order; sharded params are the live DTensors."""
        self.model.reshard()  # the root keeps its params unsharded after a no-grad forward
        live = dict(self.model.named_parameters(remove_duplicate=False))
        live.update(self.model.named_buffers(remove_duplicate=False))
        first: dict[int, str] = {}
        out = []
        for name in self.model.state_dict(keep_vars=True):
            t = live[name]
            out.append((name, t, first.get(id(t))))
            first.setdefault(id(t), name)
        return out

    @property
    def version(self) -> int:
        return self._version

    def _require_setup(self) -> None:
        if self.model is None:
            raise RuntimeError("TorchBackend.setup() must be called before use")

    # -- batching ----------------------------------------------------------------

    def _batch(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids``/``attention_mask`` ``[B, L]``, and for the
        response: gather index ``[B, T]`` into the logits and ``mask`` ``[B, T]``."""
        if not samples:
            raise ValueError("empty batch")
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        width = max(lengths)
        num_resp = max(max(len(s.response_ids) for s in samples), 1)
        # Built in numpy, moved once: per-row tensor writes cost a copy (and on CUDA a launch) each.
        ids = np.full((len(samples), width), self.pad_id, dtype=np.int64)
        # Logits at position p predict token p + 1, so response token j of a
        # sample with prompt length P is scored by the logits at P - 1 + j.
        pos = np.zeros((len(samples), num_resp), dtype=np.int64)
        for i, s in enumerate(samples):
            if len(s.prompt_ids) == 0:  # a list or an array
                raise ValueError(f"sample {s.uid!r} has an empty prompt")
            p, n = len(s.prompt_ids), len(s.response_ids)
            ids[i, :p] = s.prompt_ids
            ids[i, p : p + n] = s.response_ids
            pos[i, :n] = np.arange(p - 1, p - 1 + n)
        cols = np.arange(width)
        attn = (cols[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
        resp = np.asarray([len(s.response_ids) for s in samples])
        mask = (np.arange(num_resp)[None, :] < resp[:, None]).astype(np.float32)
        ids, attn, pos, mask = (torch.from_numpy(a) for a in (ids, attn, pos, mask))
        return ids.to(self.device), attn.to(self.device), pos.to(self.device), mask.to(self.device)

    def _response_logprobs(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs ``[B, T]`` of each response token (T=1), entropy ``[B, T]`` and mask."""
        ids, attn, pos, mask = self._batch(samples)
        logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits  # [B, L, V]
        idx = pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        resp_logits = torch.gather(logits, 1, idx).float()  # [B, T, V]
        logp_all = torch.log_softmax(resp_logits, dim=-1)
        targets = torch.gather(ids, 1, (pos + 1).clamp(max=ids.shape[1] - 1))  # [B, T]
        logprobs = torch.gather(logp_all, 2, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logprobs * mask, entropy, mask

    # -- endpoints -----------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token log-probs under the current weights (temperature 1).
        Data parallel: every rank calls it at once with its own samples (none is
        fine there: the rank still joins the forward's all-gathers)."""
        self._require_setup()
        if self.world_size > 1:
            self._agree(batch_error(samples), [])
            # one forward on every rank, a filler row where a rank has no samples
            logprobs, _, _ = self._response_logprobs(samples or [self._filler()])
            self.model.reshard()  # the root keeps its params gathered after a forward
        else:
            logprobs, _, _ = self._response_logprobs(samples)
        return [logprobs[i, : len(s.response_ids)].tolist() for i, s in enumerate(samples)]

    def train_step(
        self,
        samples: list[Sample],
        advantages: list[float],
        proximal_logprobs: list[list[float]] | None = None,
    ) -> dict[str, float]:
        """One AdamW step on the batch with the configured loss; raises ``version`` by 1.

        ``advantages[i]`` belongs to ``samples[i]`` and applies to all its
        response tokens; each sample's ``rollout_logprobs`` are the behaviour
        log-probs (one per response token). For a loss that needs proximal
        log-probs (``decoupled_ppo``) pass what :meth:`compute_logprobs`
        returned for this batch, or leave ``None`` and they are recomputed
        here from the current weights (one extra forward pass).
        """
        self._require_setup()
        passes, total_tokens = self._plan_passes(samples, advantages, proximal_logprobs)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for idx in passes:
            if idx is None:  # a weight-0 pass: its collectives match a busier rank's
                prox = None if proximal_logprobs is None else [[0.0]]
                for k in self._accumulate([self._filler()], [0.0], prox, 0.0):
                    sums.setdefault(k, 0.0)
                continue
            part = [samples[i] for i in idx]
            prox = None if proximal_logprobs is None else [proximal_logprobs[i] for i in idx]
            weight = sum(len(s.response_ids) for s in part) / max(total_tokens, 1)
            for k, v in self._accumulate(part, [advantages[i] for i in idx], prox, weight).items():
                sums[k] = sums.get(k, 0.0) + v * weight
        if self.world_size > 1:  # the ranks' token-weighted sums add up to the batch's means
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
        return {**sums, "grad_norm": float(grad_norm), "tokens": float(total_tokens),
                "version": float(self._version)}

    def _enable_activation_checkpointing(self) -> None:
        """Hugging Face's per-layer checkpointing, which runs only in training mode:
        the model is put in it, refused if that would turn on dropout."""
        dropout = {k: v for k, v in self.model.config.to_dict().items()
                   if "dropout" in k and isinstance(v, (int, float)) and v > 0}
        if dropout or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()):
            raise ValueError(f"trainer.activation_checkpointing: this model has dropout "
                             f"({dropout or 'a Dropout module'}), which checkpointing's training mode would turn on")
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise ValueError(f"trainer.activation_checkpointing: {type(self.model).__name__} does not support it")
        kwargs = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers 5's name
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.model.train()

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
            return micro_batches(samples, self.micro_batch_tokens), sum(len(s.response_ids) for s in samples)
        local = micro_batches(samples, self.micro_batch_tokens) if samples else []
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

    def _accumulate(self, samples: list[Sample], advantages: list[float],
                    proximal_logprobs: list[list[float]] | None, weight: float) -> dict[str, float]:
        """Forward + backward of one micro-batch; its loss (a token mean over the
        micro-batch) is scaled by its share of the batch's tokens, so the summed
        gradient is that of the token mean over the whole batch."""
        extra = {}
        if self.loss.needs_proximal and proximal_logprobs is None:
            # The weights before this step are the proximal policy.
            with torch.no_grad():
                extra["proximal_logprobs"] = self._response_logprobs(samples)[0]
        logprobs, entropy, mask = self._response_logprobs(samples)
        if self.loss.needs_proximal and proximal_logprobs is not None:
            extra["proximal_logprobs"] = pad_values(samples, proximal_logprobs, "proximal_logprobs", like=logprobs)
        rollout = pad_values(samples, [s.rollout_logprobs for s in samples], "rollout_logprobs", like=logprobs)
        adv = torch.tensor(advantages, dtype=logprobs.dtype, device=logprobs.device)
        loss, metrics = self.loss(logprobs, rollout, adv, mask, **extra)
        (loss * weight).backward()
        num_tokens = float(mask.sum())
        return {
            "loss": float(loss.detach()),
            "entropy": float((entropy.detach() * mask).sum() / max(num_tokens, 1.0)),
            **{k: float(v) for k, v in metrics.items()},
        }

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
            for name, t, tied in self._live_tensors():
                local = out[tied] if tied is not None else _local(t, self._specs[name])
                if tied is None and dtype is not None and local.is_floating_point():
                    local = local.to(dtype)
                out[name] = local
            return out
        for name, tensor in self.model.state_dict(keep_vars=False).items():
            t = tensor.detach()
            out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        return out

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
            return self._save_sharded(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        (path / "trainer_state.json").write_text(json.dumps({"version": self._version, "loss": self.loss.name}))

    def load(self, directory: str | pathlib.Path) -> None:
        """Restore weights, optimizer state and version written by :meth:`save`."""
        self._require_setup()
        path = pathlib.Path(directory)
        for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
            if not (path / name).is_file():
                raise ValueError(f"checkpoint {str(path)!r} has no {name}")
        if self.world_size > 1:
            return self._load_sharded(path)
        state = safetensors.torch.load_file(str(path / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # A tied lm_head is saved once, under the embedding's name.
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"checkpoint {str(path)!r} does not match the model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True))
        self._version = int(json.loads((path / "trainer_state.json").read_text())["version"])

    # Data parallel, the checkpoint is the same files as one worker's: full tensors
    # (weights in the model dtype; optimizer state, and the fp32 main params when
    # the model dtype is lower, as MainParamsOptimizer writes them), so it resumes
    # at any world size. Every rank takes part in the gathers, rank 0 writes;
    # loading, every rank reads the files (a shared filesystem) and keeps its slices.

    def _gathered(self, t: torch.Tensor) -> torch.Tensor | None:
        """The full ``t`` on rank 0 (host memory), None on the others; every rank must call it."""
        full = t.full_tensor() if isinstance(t, DTensor) else t
        return full.detach().cpu() if self.rank == 0 else None

    def _save_sharded(self, path: pathlib.Path) -> None:
        full: dict[str, torch.Tensor | None] = {}
        for name, t, tied in self._live_tensors():
            full[name] = full[tied] if tied is not None else self._gathered(t)
        optim = self.optimizer.state_dict()
        optim["state"] = {i: {k: self._gathered(v) if isinstance(v, DTensor) else v for k, v in st.items()}
                          for i, st in optim["state"].items()}
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            weights: dict[str, torch.Tensor] = {}
            for name, t, tied in self._live_tensors():
                w = full[name] if tied is None else weights[tied]
                weights[name] = w.to(self.dtype) if tied is None and w.is_floating_point() else w
            self.model.save_pretrained(path, state_dict=weights, safe_serialization=True)
            if self.master_dtype is not None:
                # save_pretrained wrote the params' dtype (the main params'); the weights are the model dtype's
                self.model.config.dtype = self.dtype
                self.model.config.save_pretrained(path)
                optim = {"optimizer": optim, "main_params": [full[n] for n, _ in self.model.named_parameters()]}
            torch.save(optim, path / "optimizer.pt")
            (path / "trainer_state.json").write_text(json.dumps({"version": self._version, "loss": self.loss.name}))
        dist.barrier()  # nobody reads the checkpoint before rank 0 has written it

    @torch.no_grad()
    def _load_sharded(self, path: pathlib.Path) -> None:
        state = safetensors.torch.load_file(str(path / "model.safetensors"), device="cpu")
        live = self._live_tensors()
        # A tied lm_head is saved once, under the embedding's name.
        missing = [n for n, _, tied in live if n not in state and (tied is None or tied not in state)]
        unexpected = sorted(set(state) - {n for n, _, _ in live})
        if missing or unexpected:
            raise ValueError(f"checkpoint {str(path)!r} does not match the model: missing {missing}, unexpected {unexpected}")
        for name, t, _ in live:
            if name in state:
                self._write_slice(t, state[name], name, path)
        saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        named = list(self.model.named_parameters())
        if (self.master_dtype is not None) != ("main_params" in saved):
            raise ValueError(f"checkpoint {str(path)!r}: its optimizer state is {'' if 'main_params' in saved else 'not '}"
                             f"a mixed-precision one (fp32 main params), this backend's is the other kind")
        if self.master_dtype is not None:
            if len(saved["main_params"]) != len(named):
                raise ValueError(f"checkpoint {str(path)!r} has {len(saved['main_params'])} main params for {len(named)} parameters")
            for (name, p), main in zip(named, saved["main_params"]):
                self._write_slice(p, main, name, path)  # exact: the safetensors hold them rounded
            saved = saved["optimizer"]
        for i, (name, p) in enumerate(named):  # keep this rank's slice of each full state tensor
            spec = self._specs[name]
            for k, v in saved["state"].get(i, {}).items():
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape:
                    local = v.narrow(0, spec.offset, spec.length).to(p.device).contiguous()
                    saved["state"][i][k] = DTensor.from_local(local, p.device_mesh, p.placements,
                                                              shape=p.shape, stride=p.stride())
        self.optimizer.load_state_dict(saved)
        self._version = int(json.loads((path / "trainer_state.json").read_text())["version"])

    def _write_slice(self, t: torch.Tensor, full: torch.Tensor, name: str, path: pathlib.Path) -> None:
        """Copy this rank's part of ``full`` into live tensor ``t`` (a shard or a whole buffer)."""
        if tuple(full.shape) != tuple(t.shape):
            raise ValueError(f"checkpoint {str(path)!r} has {name} of shape {tuple(full.shape)}, the model {tuple(t.shape)}")
        if isinstance(t, DTensor):
            spec = self._specs[name]
            t.to_local().copy_(full.narrow(0, spec.offset, spec.length))
        else:
            t.copy_(full)
