"""Verifiable tasks: prompts in, a reward for a response out (any finite float;
the built-in tasks' are in [0, 1]).

A task speaks token ids, not text: prompts are built straight from the
tokenizer's vocabulary and rewards are computed on response ids, so no
detokenisation quirk can change a reward.

Built-in tasks (no downloads; they use the built-in one-token-per-symbol
tokenizer, :func:`build_symbol_tokenizer`, which the built-in tiny model was
trained with and ships; pass ``tokenizer=`` to use another that has the symbols):

    reverse_digits   "<bos> R 3 1 4 :"  ->  "4 1 3 <eos>"    (3-5 digits by default)
    long_tail_copy   "<bos> C 3 1 4 :"  ->  "3 1 4 <eos>"    (heavy-tailed lengths)

Text tasks (for real models) speak text at the edges instead: a prompt is
rendered with the model's tokenizer (its chat template, or raw), and a response
is decoded (special tokens skipped) and scored by a reward function on text
(``policies.rewards``). They need the model directory for the tokenizer, which
the composition root passes as ``make_task(..., model_path=...)``
(:mod:`policies.text_tasks`):

    text_dataset     prompts (text or chat messages) and answers from a JSONL/Parquet
                     file, a ``datasets`` directory or rows passed from Python
                     (``policies.datasets``)
    text_arithmetic  "What is 37 + 48? Answer with the number only." -> "85"
                     (generated, with a disjoint held-out split; no downloads)

Every task has ``eval_prompts(n)``: n fixed held-out prompts, the same on every
call, for a greedy evaluation.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Mapping

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from policies.task_base import Prompt, Task
from policies.text_tasks import TextArithmetic, TextDataset

__all__ = ["Prompt", "Task", "TextArithmetic", "TextDataset", "build_symbol_tokenizer", "make_task",
           "positional_reward", "register_task"]

#: One token per symbol. ``build_symbol_tokenizer`` turns this into a real
#: HF fast tokenizer; the order fixes the token ids of the built-in model.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
SYMBOLS = tuple("0123456789") + (":", "R", "C", "+", "-", "=", " ")


def build_symbol_tokenizer():
    """A Hugging Face fast tokenizer with one token per symbol, special tokens
    first (ids 0..3): the vocabulary of the built-in tiny model (``tools.warmstart``
    saves it next to the weights). Built in memory; nothing is read or downloaded."""
    import transformers  # about 1 s to import: only a run that builds this tokenizer pays it

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + SYMBOLS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Every character is its own word, so "R123:" encodes as R,1,2,3,: .
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # decode without spaces between symbols
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tok.padding_side = "left"  # decoder-only generation pads on the left
    return tok


def positional_reward(answer: list[int], response: list[int], stop_ids: tuple[int, ...], *, no_stop_factor: float = 0.5) -> float:
    """Dense reward for "emit exactly this token sequence, then stop".

    The response is cut at its first stop token. The score is the number of
    positions where it agrees with the answer divided by the longer of the two
    lengths, so both wrong tokens and wrong lengths cost in proportion — every
    extra correct digit is worth something, which gives GRPO a gradient long
    before whole answers are right. A response that never stops is multiplied
    by ``no_stop_factor`` so full credit needs the stop token.
    """
    stopped = False
    for i, tok in enumerate(response):
        if tok in stop_ids:
            response, stopped = response[:i], True
            break
    denom = max(len(answer), len(response))
    if denom == 0:
        return 1.0 if stopped else 0.0
    score = sum(a == b for a, b in zip(answer, response)) / denom
    return score if stopped else score * no_stop_factor


class _SymbolTask(Task):
    """Shared plumbing for tasks over the one-token-per-symbol vocabulary."""

    def __init__(self, tokenizer=None):
        if tokenizer is None:
            tokenizer = build_symbol_tokenizer()
        self.tokenizer = tokenizer
        ids = tokenizer.convert_tokens_to_ids(list(SYMBOLS) + ["<bos>", "<eos>"])
        unk = tokenizer.unk_token_id
        missing = [s for s, i in zip(list(SYMBOLS) + ["<bos>", "<eos>"], ids) if i is None or (unk is not None and i == unk)]
        if missing:
            raise ValueError(f"tokenizer lacks the task symbols {missing}; use the built-in tiny-qwen2 tokenizer")
        self._id = dict(zip(list(SYMBOLS) + ["<bos>", "<eos>"], ids))
        self.stop_token_ids = (self._id["<eos>"],)

    def _digits(self, rng: random.Random, length: int) -> str:
        return "".join(rng.choice("0123456789") for _ in range(length))

    def _prompt(self, marker: str, digits: str, answer: str) -> Prompt:
        ids = [self._id["<bos>"], self._id[marker]] + [self._id[d] for d in digits] + [self._id[":"]]
        return Prompt(prompt_ids=ids, meta={"answer": answer})

    def answer_ids(self, meta: dict[str, str]) -> list[int]:
        """The token ids of the reference answer (without the stop token)."""
        return [self._id[d] for d in meta["answer"]]

    def reward(self, meta: dict[str, str], response_ids: list[int]) -> float:
        return positional_reward(self.answer_ids(meta), list(response_ids), self.stop_token_ids)


class ReverseDigits(_SymbolTask):
    """Reverse a string of ``min_len``..``max_len`` digits (uniform length).

    The default 3..5 keeps responses short (<= 6 tokens with ``<eos>``) so
    GRPO credit assignment is sharp and a CPU run learns in a few hundred steps.
    """

    def __init__(self, tokenizer=None, *, min_len: int = 3, max_len: int = 5):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"reverse_digits needs 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        super().__init__(tokenizer)
        self.min_len, self.max_len = min_len, max_len

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            digits = self._digits(rng, rng.randint(self.min_len, self.max_len))
            out.append(self._prompt("R", digits, digits[::-1]))
        return out


class LongTailCopy(_SymbolTask):
    """Copy a digit string whose length is heavy-tailed (Pareto).

    Length = ``min_len * U**(-1/tail_alpha)`` rounded down, capped at
    ``max_len``, U uniform in (0, 1]. The median is ``min_len * 2**(1/alpha)``;
    with the defaults (min 3, alpha 1.2, cap 40) the median answer has ~5
    digits while about 1 in 20 has 35 or more — the few long answers that
    hold a synchronous step back.
    """

    def __init__(self, tokenizer=None, *, min_len: int = 3, tail_alpha: float = 1.2, max_len: int = 40):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"long_tail_copy needs 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        if tail_alpha <= 0:
            raise ValueError(f"long_tail_copy needs tail_alpha > 0, got {tail_alpha}")
        super().__init__(tokenizer)
        self.min_len, self.tail_alpha, self.max_len = min_len, tail_alpha, max_len

    def sample_length(self, rng: random.Random) -> int:
        """One answer length from the capped Pareto distribution."""
        u = 1.0 - rng.random()  # in (0, 1]
        return min(self.max_len, int(math.floor(self.min_len * u ** (-1.0 / self.tail_alpha))))

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            digits = self._digits(rng, self.sample_length(rng))
            out.append(self._prompt("C", digits, digits))
        return out

_TASKS: dict[str, Callable[..., Task]] = {
    "reverse_digits": ReverseDigits,
    "long_tail_copy": LongTailCopy,
    "text_dataset": TextDataset,
    "text_arithmetic": TextArithmetic,
}

#: What the composition root knows and passes to every task; a factory gets
#: each only when its signature names it (the symbol tasks take neither).
CONTEXT_OPTIONS = ("model_path", "reward_timeout_s")


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Add a task factory under ``name`` (a plain function or class). A factory
    that names ``model_path`` / ``reward_timeout_s`` gets them from ``make_task``."""
    _TASKS[name] = factory


def task_factory(name: str) -> Callable[..., Task]:
    """The factory registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(_TASKS))}")
    return _TASKS[name]


def make_task(name: str, *, model_path: str | None = None, reward_timeout_s: float | None = None,
              **kwargs) -> Task:
    """Build the task registered as ``name`` with its keyword options.

    ``model_path`` (the model directory, for a text task's tokenizer) and
    ``reward_timeout_s`` (``policy.reward_timeout_s``, which also bounds a user
    reward function's own thread) come from the composition root, not from
    ``task.kwargs``; each reaches only factories whose signature names it.

    Raises ``ValueError`` naming the task when it is unknown or its options are wrong.
    """
    factory = task_factory(name)
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: pass no context
        params = {}
    context = {"model_path": model_path, "reward_timeout_s": reward_timeout_s}
    kwargs.update({k: v for k, v in context.items() if v is not None and k in params})
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for task {name!r}: {e}") from None
