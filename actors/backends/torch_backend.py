"""The plain-PyTorch trainer backend: one HF causal LM, AdamW, an injected loss.

Every method is synchronous and blocking; the trainer actor calls them on its
worker thread so the event loop never waits on a matmul.

    samples ─► pad to [B, T] (prompt + response, right-padded)
            ─► forward ─► log-probs of the response tokens [B, T_resp]
            ─► loss(logprobs, rollout_logprobs, advantages, mask) ─► AdamW step
            ─► version += 1 ─► named_weights() for the weight sync
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import safetensors.torch
import torch

from actors.backends.base import Loss, TrainerBackend
from actors.backends.config import TrainerConfig
from actors.backends.mixed_precision import MainParamsOptimizer
from actors.models import load_causal_lm, resolve_model_path
from contracts.sample import Sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULTS = TrainerConfig()  # the one set of defaults: the config's


class TorchBackend(TrainerBackend):
    """Trains a local HF causal LM with one optimizer step per batch.

    Runs build it with :func:`actors.backends.make_backend` from their
    ``trainer`` section; the keyword defaults here are that section's
    (:class:`~actors.backends.config.TrainerConfig`), for direct use in tests.
    ``loss``: the loss to train with, options bound
    (``policies.losses.make_loss("ppo_clip", clip_eps_low=0.2)``).
    ``version`` counts optimizer steps since the loaded checkpoint (0 at
    start); it is the weight version rollouts are stamped with.
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
        micro_batch_tokens: int = _DEFAULTS.micro_batch_tokens,
        master_dtype: str | None = _DEFAULTS.master_dtype,
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
        if micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens must be >= 0, got {micro_batch_tokens}")
        # Padded tokens (rows x longest row) per forward; 0 = the whole batch at once.
        self.micro_batch_tokens = micro_batch_tokens
        self.seed = seed
        self._version = 0
        self.model = None
        self.optimizer = None

    # -- setup -----------------------------------------------------------------

    def setup(self) -> None:
        """Load the model and build the optimizer (heavy; call once, off the loop)."""
        torch.manual_seed(self.seed)
        model_dir = resolve_model_path(self.model_path)
        self.model = load_causal_lm(model_dir, device=self.device, dtype=self.dtype)
        # No dropout in RL: the log-probs we train on must match the sampler's.
        self.model.eval()
        def adamw(params):
            return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)

        if self.master_dtype is None:
            self.optimizer = adamw(self.model.parameters())
        else:
            self.optimizer = MainParamsOptimizer(self.model.parameters(), adamw, self.master_dtype)
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0

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
        """Per-response-token log-probs under the current weights (temperature 1)."""
        self._require_setup()
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
        if len(advantages) != len(samples):
            raise ValueError(f"got {len(advantages)} advantages for {len(samples)} samples")
        if proximal_logprobs is not None and len(proximal_logprobs) != len(samples):
            raise ValueError(f"got proximal_logprobs for {len(proximal_logprobs)} samples, expected {len(samples)}")
        total_tokens = sum(len(s.response_ids) for s in samples)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for idx in self._micro_batches(samples):
            part = [samples[i] for i in idx]
            prox = None if proximal_logprobs is None else [proximal_logprobs[i] for i in idx]
            weight = sum(len(s.response_ids) for s in part) / max(total_tokens, 1)
            for k, v in self._accumulate(part, [advantages[i] for i in idx], prox, weight).items():
                sums[k] = sums.get(k, 0.0) + v * weight
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        if isinstance(self.optimizer, MainParamsOptimizer):
            grad_norm = self.optimizer.clip_and_step(max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            self.optimizer.step()
        self._version += 1
        return {**sums, "grad_norm": float(grad_norm), "tokens": float(total_tokens),
                "version": float(self._version)}

    def _micro_batches(self, samples: list[Sample]) -> list[list[int]]:
        """Indices split so rows x longest row <= ``micro_batch_tokens``, rows
        sorted by length: a long-tailed batch stops padding every row to its longest."""
        if not self.micro_batch_tokens:
            return [list(range(len(samples)))]
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].response_ids))
        out: list[list[int]] = [[]]
        for i in order:
            width = len(samples[i].prompt_ids) + len(samples[i].response_ids)
            if out[-1] and (len(out[-1]) + 1) * width > self.micro_batch_tokens:
                out.append([])
            out[-1].append(i)
        return out

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
            extra["proximal_logprobs"] = self._pad(samples, proximal_logprobs, "proximal_logprobs", like=logprobs)
        rollout = self._pad(samples, [s.rollout_logprobs for s in samples], "rollout_logprobs", like=logprobs)
        adv = torch.tensor(advantages, dtype=logprobs.dtype, device=logprobs.device)
        loss, metrics = self.loss(logprobs, rollout, adv, mask, **extra)
        (loss * weight).backward()
        num_tokens = float(mask.sum())
        return {
            "loss": float(loss.detach()),
            "entropy": float((entropy.detach() * mask).sum() / max(num_tokens, 1.0)),
            **{k: float(v) for k, v in metrics.items()},
        }

    @staticmethod
    def _pad(samples: list[Sample], values: list[list[float]], what: str, *, like: torch.Tensor) -> torch.Tensor:
        """Per-token values (one list per sample) as a zero-padded tensor shaped ``like`` ``[B, T]``."""
        if len(values) != len(samples):
            raise ValueError(f"got {what} for {len(values)} samples, expected {len(samples)}")
        out = np.zeros(tuple(like.shape), dtype=np.float32)
        for i, (s, v) in enumerate(zip(samples, values)):
            if len(v) != len(s.response_ids):
                raise ValueError(f"sample {s.uid!r} has {len(v)} {what} for {len(s.response_ids)} response tokens")
            out[i, : len(v)] = v
        return torch.from_numpy(out).to(device=like.device, dtype=like.dtype)

    def named_weights(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer under its HF name, detached.

        Tied weights appear under each of their names (``lm_head.weight`` as
        well as ``model.embed_tokens.weight``) as ``state_dict()`` lists them,
        so a receiver can match names one to one. ``dtype`` converts (a copy);
        ``None`` returns the live tensors without copying — do not modify them.
        """
        self._require_setup()
        if isinstance(dtype, str):
            dtype = _DTYPES[dtype]
        out = {}
        for name, tensor in self.model.state_dict(keep_vars=False).items():
            t = tensor.detach()
            out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        return out

    # -- checkpoints -------------------------------------------------------------

    def save(self, directory: str | pathlib.Path) -> None:
        """Write an HF-loadable checkpoint (config + safetensors), the optimizer
        state (``optimizer.pt``) and ``trainer_state.json`` (version) into ``directory``."""
        self._require_setup()
        path = pathlib.Path(directory)
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
        state = safetensors.torch.load_file(str(path / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # A tied lm_head is saved once, under the embedding's name.
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"checkpoint {str(path)!r} does not match the model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True))
        self._version = int(json.loads((path / "trainer_state.json").read_text())["version"])
