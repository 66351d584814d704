"""The trainer-backend protocol: what a trainer actor needs from the code
that holds the policy weights and steps the optimizer.

    backend = make_backend(cfg.trainer, model_path, seed=seed, loss=loss)  # not set up
    backend.setup()                                   # heavy: load weights, build the optimizer
    backend.compute_logprobs(samples)                 # per response token, current weights
    backend.train_step(samples, advantages)           # one optimizer step; version += 1
    backend.named_weights(dtype), backend.shard_specs()   # what the weight sync pushes
    backend.save(dir) / backend.load(dir)             # safetensors + optimizer state

Every method is synchronous and blocking; the trainer actor calls them on its
worker thread so the event loop never waits on a matmul. The loss is policy
math: the composition root builds it (``policies.losses``) and injects it, so
no backend imports ``policies``.
"""

from __future__ import annotations

import abc
import json
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from contracts.sample import Sample
from contracts.weights import ShardSpec

if TYPE_CHECKING:
    import torch

__all__ = ["CHECKPOINT_FILES", "Loss", "TrainerBackend", "check_checkpoint", "read_trainer_version",
           "write_trainer_state"]

#: The files of a trainer checkpoint, the same for every backend (either resumes the other's):
#: Hugging Face weights, the optimizer state in torch's AdamW format, the version and loss.
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "trainer_state.json")


class Loss(Protocol):
    """The loss a backend runs, with its options bound (``policies.losses.Loss``).

    Called as ``loss(logprobs, rollout_logprobs, advantages, mask,
    proximal_logprobs=None) -> (scalar loss, {metric: 0-d tensor or float})`` on ``[B, T]``
    tensors (``advantages`` ``[B]``); ``needs_proximal``: it needs the log-probs of
    the weights before the step; ``name`` goes into checkpoints. It travels to
    child processes and Ray actors, so it must pickle by reference.
    """

    name: str
    needs_proximal: bool

    def __call__(self, logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, proximal_logprobs: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]: ...


class TrainerBackend(abc.ABC):
    """Holds the trained weights and their optimizer (one trainer actor's).

    ``version`` counts optimizer steps since the loaded checkpoint (0 at
    start); it is the weight version rollouts are stamped with. ``device`` is
    where the weights live (the weight sync's transports read it).
    """

    device: torch.device

    @abc.abstractmethod
    def setup(self) -> None:
        """Load the model and build the optimizer (heavy; call once, off the loop)."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Optimizer steps taken since the loaded checkpoint."""

    @abc.abstractmethod
    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per-response-token log-probs under the current weights (temperature 1), one list per sample."""

    @abc.abstractmethod
    def train_step(self, samples: Sequence[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """One optimizer step on the batch (``advantages[i]`` belongs to ``samples[i]``);
        raises :attr:`version` by 1 and returns the step's metrics."""

    @abc.abstractmethod
    def named_weights(self, dtype: str | None = None) -> dict[str, torch.Tensor]:
        """This rank's weights under their Hugging Face names (local shards when
        :meth:`shard_specs` is not None). ``dtype`` converts (a copy); ``None``
        gives the live tensors, which must not be modified."""

    def shard_specs(self) -> dict[str, ShardSpec] | None:
        """Which slice of each full tensor :meth:`named_weights` holds; ``None``:
        every tensor is whole (an unsharded backend)."""
        return None

    @abc.abstractmethod
    def save(self, path: str | pathlib.Path) -> None:
        """Write a checkpoint (safetensors weights + optimizer state + version) into directory ``path``."""

    @abc.abstractmethod
    def load(self, path: str | pathlib.Path) -> None:
        """Restore what :meth:`save` wrote; raises ``ValueError`` naming what is missing or does not match."""


def check_checkpoint(path: pathlib.Path) -> None:
    """Raise ``ValueError`` naming the first of :data:`CHECKPOINT_FILES` that ``path`` lacks."""
    for name in CHECKPOINT_FILES:
        if not (path / name).is_file():
            raise ValueError(f"checkpoint {str(path)!r} has no {name}")


def write_trainer_state(path: pathlib.Path, version: int, loss: Loss) -> None:
    """``trainer_state.json``: the weights' version and the loss they were trained with."""
    (path / "trainer_state.json").write_text(json.dumps({"version": version, "loss": loss.name}))


def read_trainer_version(path: pathlib.Path) -> int:
    """The version :func:`write_trainer_state` wrote into ``path``."""
    return int(json.loads((path / "trainer_state.json").read_text())["version"])
