"""What every task is: a source of :class:`Prompt` s (token ids) and a verifier
that scores a response's token ids (any finite float; the built-in tasks' are
in [0, 1]). The tasks themselves and their registry are in :mod:`policies.tasks`.
"""

from __future__ import annotations

import abc
import random

import msgspec

__all__ = ["EVAL_SEED", "Prompt", "Task"]

#: Seed of the default held-out prompts (a string: no integer ``run.seed`` equals it).
EVAL_SEED = "asyncrl/eval"


class Prompt(msgspec.Struct, kw_only=True):
    """One prompt: the ids the model conditions on, and what the reward needs
    (``meta``, e.g. ``{"answer": "4 1 3"}``) which is never shown to the model."""

    prompt_ids: list[int]
    meta: dict[str, str] = msgspec.field(default_factory=dict)


class Task(abc.ABC):
    """A source of prompts plus a verifier that scores responses (any finite float)."""

    tokenizer: object
    stop_token_ids: tuple[int, ...]

    @abc.abstractmethod
    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """Draw ``n`` independent prompts using only ``rng`` (reproducible)."""

    @abc.abstractmethod
    def reward(self, meta: dict[str, str], response_ids: list[int]) -> float:
        """Score one response (token ids, maybe ending in a stop token): any finite
        float (GRPO compares a group's scores); NaN or an infinity is counted as an error."""

    def eval_prompts(self, n: int) -> list[Prompt]:
        """At most ``n`` fixed held-out prompts, the same on every call and in
        every process. By default ``sample_prompts`` from a fixed seed of its own
        (so not disjoint from training draws); tasks with a real held-out split
        return that instead."""
        return self.sample_prompts(random.Random(EVAL_SEED), n)
