"""Text tasks (for real models): they speak text at the edges. A prompt is
rendered with the model's tokenizer (its chat template, or raw), and a response
is decoded (special tokens skipped) and scored by a reward function on text
(``policies.rewards``). They need the model directory for the tokenizer, which
the composition root passes as ``make_task(..., model_path=...)``. The two
built-in ones, ``text_dataset`` and ``text_arithmetic``, are registered (and
listed) in :mod:`policies.tasks`.
"""

from __future__ import annotations

import json
import logging
import functools
import pathlib
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, cast

from policies.config import PolicyConfig
from policies.datasets import ArithmeticProblems, Row, load_rows
from policies.rewards import Response, resolve_reward, reward_form
from policies.task_base import Prompt, Task

__all__ = ["END_OF_TURN_TOKENS", "TextArithmetic", "TextDataset", "load_tokenizer", "text_stop_token_ids"]

log = logging.getLogger(__name__)

#: End-of-turn tokens of common chat formats (ChatML/Qwen, Llama 3, Gemma, Phi-3,
#: GPT-2 style): a text task stops on those its tokenizer has as added tokens.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def load_tokenizer(model_path: str | None, task: str):
    """The tokenizer in the model directory ``model_path``, from local files only:
    the light one (``tokenizers`` + jinja2, no transformers) where it gives
    transformers' results, else ``AutoTokenizer`` (``policies/tokenizer.py`` decides).
    Raises ``ValueError`` naming the path when there is none or it cannot be read."""
    if not model_path:
        raise ValueError(f"task {task!r} needs the model directory for its tokenizer: "
                         f"build it with make_task({task!r}, model_path=...)")
    if not pathlib.Path(model_path).is_dir():
        raise ValueError(f"task {task!r}: model path {str(model_path)!r} is not a directory")
    from policies.tokenizer import load_local_tokenizer  # jinja2: only a task that loads a tokenizer pays it

    try:
        return load_local_tokenizer(model_path)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a bad directory
        raise ValueError(f"task {task!r}: cannot load a tokenizer from {str(model_path)!r}: "
                         f"{type(e).__name__}: {e}") from None


def text_stop_token_ids(tokenizer, model_path: str | None = None) -> tuple[int, ...]:
    """The ids a text response stops at: the tokenizer's eos, the eos ids of the
    model's ``generation_config.json`` (some chat models list several), and the
    end-of-turn tokens of :data:`END_OF_TURN_TOKENS` the tokenizer has."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    gen_path = pathlib.Path(model_path) / "generation_config.json" if model_path else None
    if gen_path is not None and gen_path.is_file():
        try:
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{gen_path}: not a JSON object ({e})") from None
        ids.extend(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    added = tokenizer.get_added_vocab()
    ids.extend(added[t] for t in END_OF_TURN_TOKENS if t in added)
    return tuple(dict.fromkeys(ids))


def _check_types(task: str, **values) -> None:
    """``ValueError`` naming the option whose value has the wrong type (options
    come from YAML, where ``reward: 1`` or ``chat_template: "no"`` are easy to write)."""
    for key, (value, kind) in values.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
            continue
        what = ("true or false" if bool in kinds else "a string or a function" if Callable in kinds
                else "a string" if str in kinds
                else "an integer" if kinds == (int,) else "a number")
        raise ValueError(f"task {task!r}: option {key} must be {what}, got {value!r}")


_CHAT_PROMPTS = "the prompt is chat messages, which only a chat template can render"
_CHAT_REMEDY = ("use a model whose tokenizer has a chat template (model.path), or give plain-text prompts "
                "(a string per row) with task.kwargs.chat_template=false")


class TextTokenizer(Protocol):
    """What a text task calls of its tokenizer (``transformers``' or the light
    one of :mod:`policies.tokenizer`)."""

    def apply_chat_template(self, conversation: list[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool) -> str: ...

    def __call__(self, text: list[str], add_special_tokens: bool = True) -> Mapping[str, list[list[int]]]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


class _TextTask(Task):
    """Shared plumbing for tasks whose prompts and answers are text: render
    with the tokenizer, decode the response, score it with a reward on text."""

    name = "text"
    tokenizer: TextTokenizer

    def __init__(self, tokenizer=None, *, model_path: str | None, chat_template: bool, system_prompt: str,
                 reward: str | Callable[..., object], reward_timeout_s: float | None,
                 chat_prompt_at: str | None = None) -> None:
        """``chat_prompt_at``: where the data has a prompt of chat messages (``file:row``), if it has one."""
        _check_types(self.name, chat_template=(chat_template, bool), system_prompt=(system_prompt, str),
                     reward=(reward, (str, Callable)))
        if reward_timeout_s is None:
            reward_timeout_s = PolicyConfig().reward_timeout_s
        self.score = resolve_reward(reward, timeout_s=reward_timeout_s)  # before the (slow) tokenizer load
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path, self.name)
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            if chat_prompt_at is not None:  # raw text cannot render messages: one way out, not two in a circle
                raise ValueError(f"task {self.name!r}: {chat_prompt_at}: {_CHAT_PROMPTS}, and the tokenizer of "
                                 f"{str(model_path)!r} has none: {_CHAT_REMEDY}")
            raise ValueError(f"task {self.name!r}: the tokenizer of {str(model_path)!r} has no chat template; "
                             f"set task.kwargs.chat_template=false to feed prompts as raw text")
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.stop_token_ids = text_stop_token_ids(self.tokenizer, model_path)
        if not self.stop_token_ids:
            raise ValueError(f"task {self.name!r}: the tokenizer of {str(model_path)!r} has no eos token "
                             "and no end-of-turn token; a response could never stop")

    def render(self, prompts: list[str | list[dict[str, Any]]]) -> list[list[int]]:
        """Prompt token ids for each prompt: a text, or chat messages. With the chat
        template: a text is a user turn, messages are taken as they are; a
        ``system_prompt`` turn comes first (unless the messages open with a system
        turn of their own), then the assistant's generation prompt. Raw: the text
        (after ``system_prompt`` and a blank line, when set), with the tokenizer's
        own special tokens (e.g. BOS); chat messages need the template."""
        if not prompts:
            return []
        if self.chat_template:
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            chats = [p if isinstance(p, list) and p[0].get("role") == "system"
                     else system + (p if isinstance(p, list) else [{"role": "user", "content": p}])
                     for p in prompts]
            try:
                rendered = [self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                            for chat in chats]
            except Exception as e:  # a template may refuse e.g. a system turn (jinja raise_exception)
                raise ValueError(f"task {self.name!r}: the tokenizer's chat template cannot render a prompt"
                                 f"{' with a system_prompt' if system else ''}: {type(e).__name__}: {e}") from None
            return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        prefix = self.system_prompt + "\n\n" if self.system_prompt else ""
        return self.tokenizer([prefix + cast(str, t) for t in prompts])["input_ids"]  # text: checked at load

    def prompts(self, rows: list[Row]) -> list[Prompt]:
        """``rows`` as prompts: the answer in ``meta["answer"]``, where the row was
        read in ``meta["row"]`` (the reward finds the row's other fields by it)."""
        return [Prompt(prompt_ids=list(ids), meta={"answer": row.answer, "row": row.where})
                for row, ids in zip(rows, self.render([row.prompt for row in rows]))]

    def decode(self, response_ids: list[int]) -> str:
        """The response as text: cut at its first stop token, special tokens skipped."""
        ids = list(response_ids)
        for i, tok in enumerate(ids):
            if tok in self.stop_token_ids:
                ids = ids[:i]
                break
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def row(self, meta: dict[str, str]) -> Row | None:
        """The row a prompt came from, by its ``meta``; None when rows are not kept."""
        return None

    def reward(self, meta: dict[str, str], response_ids: list[int]) -> float:
        row = self.row(meta)
        response = Response(text=self.decode(response_ids), answer=meta["answer"], ids=list(response_ids),
                            prompt=row.prompt if row else "", fields=row.fields if row else {})
        return float(self.score(response))


class TextDataset(_TextTask):
    """Prompts and ground-truth answers read from a file or a dataset.

    ``path`` / ``eval_path``: JSONL or Parquet files or ``datasets`` save_to_disk
    directories (a run resolves a relative one against the config file's
    directory, then the current one); or, from Python, ``data`` / ``eval_data``:
    a ``datasets.Dataset`` or a list of dicts. Each row has a ``prompt_field``
    (text or chat messages) and an ``answer_field``, dotted paths into nested
    records allowed (see ``policies.datasets``); ``eval_path`` (optional) holds
    the held-out rows ``eval_prompts`` serves, first rows first. Training draws
    rows uniformly, with replacement, using only the policy's rng. ``reward``:
    ``exact_match``, ``math``, ``package.module:function`` or ``file.py:function``,
    or from Python the function itself, in any of the forms of ``policies.rewards``
    (verl's and TRL's get the row's other columns; a TRL one reads no answer, so
    rows need no ``answer_field`` for it). ``chat_template``: render with the tokenizer's chat template
    (an error when it has none: set it false for raw text; chat-message prompts
    need it).
    ``max_prompt_tokens`` (0 = no limit): a row whose rendered prompt is longer
    is refused at load, counted in ``num_refused`` and logged with its
    ``file:line``; a file whose every row is refused is an error.
    """

    name = "text_dataset"

    def __init__(self, tokenizer=None, *, path: str = "", model_path: str | None = None, eval_path: str = "",
                 data: Iterable[Mapping[str, object]] | None = None,
                 eval_data: Iterable[Mapping[str, object]] | None = None, prompt_field: str = "prompt", answer_field: str = "answer",
                 chat_template: bool = True, system_prompt: str = "", reward: str | Callable[..., object] = "math",
                 max_prompt_tokens: int = 0, reward_timeout_s: float | None = None) -> None:
        _check_types(self.name, path=(path, str), eval_path=(eval_path, str), prompt_field=(prompt_field, str),
                     answer_field=(answer_field, str), max_prompt_tokens=(max_prompt_tokens, int),
                     chat_template=(chat_template, bool), reward=(reward, (str, Callable)))
        if max_prompt_tokens < 0:
            raise ValueError(f"task {self.name!r}: max_prompt_tokens must be >= 0 (0 = no limit), "
                             f"got {max_prompt_tokens}")
        if bool(path) == (data is not None) or (eval_path and eval_data is not None):
            raise ValueError(f"task.kwargs: task {self.name!r} needs one source of rows: path (a file or a datasets directory) "
                             "or data (a datasets.Dataset or a list of dicts, from Python), and at most one of "
                             "eval_path and eval_data")
        answer_required = reward_form(reward) != "trl"  # TRL's form reads no answer
        fields = functools.partial(load_rows, prompt_field=prompt_field, answer_field=answer_field,
                                   answer_required=answer_required)
        # bad data fails before the tokenizer load
        if path:
            train_rows = fields(path)
        else:
            assert data is not None  # one source of rows: checked above
            train_rows = fields(data, name="data")
        eval_rows = (fields(eval_path) if eval_path else
                     fields(eval_data, name="eval_data") if eval_data is not None else [])
        chat = next((row for row in train_rows + eval_rows if isinstance(row.prompt, list)), None)
        if chat is not None and not chat_template:
            raise ValueError(f"task {self.name!r}: {chat.where}: {_CHAT_PROMPTS}: set task.kwargs.chat_template=true "
                             f"if the tokenizer of model.path has one; else {_CHAT_REMEDY}")
        super().__init__(tokenizer, model_path=model_path, chat_template=chat_template,
                         system_prompt=system_prompt, reward=reward, reward_timeout_s=reward_timeout_s,
                         chat_prompt_at=None if chat is None else chat.where)
        self.path = path or "data"
        self.eval_path = eval_path or ("eval_data" if eval_data is not None else "")
        self.max_prompt_tokens = max_prompt_tokens
        self.num_refused: dict[str, int] = {}
        self._rows = {row.where: row for row in train_rows + eval_rows}  # what a reward may read of its row
        self._train = self._admit("train", self.path, train_rows)
        self._eval = self._admit("eval", self.eval_path, eval_rows) if eval_rows else []

    def row(self, meta: dict[str, str]) -> Row | None:
        return self._rows.get(meta.get("row", ""))

    def _admit(self, split: str, path: str, rows: list[Row]) -> list[Prompt]:
        prompts = self.prompts(rows)
        if not self.max_prompt_tokens:
            return prompts
        kept = [p for p in prompts if len(p.prompt_ids) <= self.max_prompt_tokens]
        refused = [row.where for row, p in zip(rows, prompts) if len(p.prompt_ids) > self.max_prompt_tokens]
        self.num_refused[split] = len(refused)
        if not kept:
            raise ValueError(f"dataset {path!r}: every row's prompt is longer than max_prompt_tokens="
                             f"{self.max_prompt_tokens} (e.g. {refused[0]})")
        if refused:
            log.warning("dataset %r: refused %d of %d rows whose prompt is longer than max_prompt_tokens=%d: %s%s",
                        path, len(refused), len(rows), self.max_prompt_tokens, ", ".join(refused[:5]),
                        ", ..." if len(refused) > 5 else "")
        return kept

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [self._train[rng.randrange(len(self._train))] for _ in range(n)]

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first ``n`` rows of ``eval_path`` (all of them when it has fewer).
        Raises ``ValueError`` when no ``eval_path`` was given."""
        if not self.eval_path:
            raise ValueError(f"task {self.name!r} has no held-out rows: set task.kwargs.eval_path "
                             "(or policy.eval_every=0)")
        return self._eval[:n]


class TextArithmetic(_TextTask):
    """Integer arithmetic in words, generated on the fly (no downloads), scored
    by ``reward`` (``math`` by default: the final number of the response).
    The problem options are those of ``policies.datasets.ArithmeticProblems``
    (``digits``, ``num_operands``, ``ops``, ``tail_alpha`` for a heavy tail of
    answer lengths, ``max_digits``, ``eval_fraction``, ``instruction``);
    ``eval_prompts`` serves its held-out split, which training never draws."""

    name = "text_arithmetic"

    def __init__(self, tokenizer=None, *, model_path: str | None = None, digits: int = 2, num_operands: int = 2,
                 ops: str = "+-", tail_alpha: float = 0.0, max_digits: int = 12, eval_fraction: float = 0.1,
                 instruction: str = "Answer with the number only.", chat_template: bool = True,
                 system_prompt: str = "", reward: str | Callable[..., object] = "math",
                 reward_timeout_s: float | None = None) -> None:
        _check_types(self.name, digits=(digits, int), num_operands=(num_operands, int), ops=(ops, str),
                     tail_alpha=(tail_alpha, (int, float)), max_digits=(max_digits, int),
                     eval_fraction=(eval_fraction, (int, float)), instruction=(instruction, str))
        self.problems = ArithmeticProblems(digits=digits, num_operands=num_operands, ops=ops,
                                           tail_alpha=float(tail_alpha), max_digits=max_digits,
                                           eval_fraction=float(eval_fraction), instruction=instruction)
        super().__init__(tokenizer, model_path=model_path, chat_template=chat_template,
                         system_prompt=system_prompt, reward=reward, reward_timeout_s=reward_timeout_s)
        self._eval: list[Prompt] = []
        self.render([self.problems.question("1 + 1")])  # a template that cannot render fails here, not mid-run

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return self.prompts([self.problems.sample(rng) for _ in range(n)])

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first ``n`` problems of the held-out split (fewer when the problem
        space has fewer), rendered once and kept."""
        if len(self._eval) < n:
            self._eval = self.prompts(self.problems.held_out(n))
        return self._eval[:n]
