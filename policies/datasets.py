"""Where text prompts come from: rows read from a file or a dataset (JSONL,
Parquet when pyarrow is installed, a Hugging Face ``datasets`` directory written
by ``Dataset.save_to_disk``, or a ``datasets.Dataset`` / list of dicts passed
from Python), or the built-in generator of arithmetic problems.

A row is a prompt (shown to the model: a string, or chat messages
``[{"role": "user", "content": ...}, ...]`` as verl and TRL write them) and its
ground-truth answer (text the reward compares against), plus the whole record
(every column, for user rewards that take them) and where it came from
(``file:line``, ``file:row N``) so that every error names it. Rows are
validated on load: a bad one is an error naming the file, the line (1-based;
``row N`` for tables) and the field — never skipped.

Field names may be dotted paths into nested records: ``reward_model.ground_truth``
is ``record["reward_model"]["ground_truth"]`` (a key that itself holds the dots
is taken first). The prompt must be a non-empty string or a non-empty list of
messages, each with a string ``role`` and ``content``; the answer a non-empty
string or a number (turned into its text: ``42`` -> ``"42"``). A reward that
reads no answer (TRL's form) loads rows with ``answer_required=False``: the
answer is then the field's text when it is one, else "".

JSONL: one JSON object per line; blank lines are ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import random
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

__all__ = ["ArithmeticProblems", "Row", "load_rows"]


_Fields = tuple[str, str, bool]  # (prompt_field, answer_field, answer_required)


class Row(msgspec.Struct, frozen=True):
    """One validated example: the ``prompt`` (text, or chat messages) and the
    ``answer`` text, ``where`` it was read (``file:line``), and the whole
    record as read (``fields``: every column, nested ones as dicts)."""

    prompt: str | list[dict[str, object]]
    answer: str
    where: str
    fields: dict[str, object] = msgspec.field(default_factory=dict)


def load_rows(source: str | os.PathLike | Iterable[Mapping[str, object]], *, prompt_field: str = "prompt",
              answer_field: str = "answer", name: str = "data", answer_required: bool = True) -> list[Row]:
    """Every row of ``source``, in order: a JSONL or Parquet (``.parquet``/``.pq``)
    file or a ``datasets`` ``save_to_disk`` directory at that path (absolute, or
    relative to the current directory), or rows given as they are: a
    ``datasets.Dataset`` or any iterable of dicts (named ``name`` in errors).

    Raises ``ValueError`` naming the file — and the line and field where one is
    at fault — when the file is missing, empty, not JSON, or a row lacks a
    field or has one of the wrong type (the answer field: only when ``answer_required``)."""
    fields = (prompt_field, answer_field, answer_required)
    if isinstance(source, Mapping):  # a DatasetDict, say: iterating it would give split names
        raise ValueError(f"dataset {name!r} is a mapping ({', '.join(map(str, source))}), not rows: "
                         "give one split, e.g. ds['train']")
    if not isinstance(source, (str, os.PathLike)):
        rows = _dataset_rows(source, name, fields)
        if not rows:
            raise ValueError(f"dataset {name!r}: no rows")
        return rows
    p = pathlib.Path(source).expanduser()
    if p.is_dir():
        rows = _disk_rows(p, str(source), fields)
    elif not p.is_file():
        raise ValueError(f"dataset {str(source)!r}: no such file (looked for {p.absolute()})")
    elif p.suffix in (".parquet", ".pq"):
        rows = _parquet_rows(p, str(source), fields)
    else:
        rows = _jsonl_rows(p, str(source), fields)
    if not rows:
        raise ValueError(f"dataset {str(source)!r}: the file has no rows")
    return rows


def _jsonl_rows(p: pathlib.Path, name: str, fields: _Fields) -> list[Row]:
    rows = []
    try:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{name}:{lineno}"
                line = line.rstrip("\r\n")
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:  # e.colno would count from a newline inside the row
                    at = "the end of the line" if e.pos >= len(line) else f"column {e.pos + 1}"
                    raise ValueError(f"{where}: not JSON ({e.msg} at {at}); "
                                     "expected one JSON object per line") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{where}: expected a JSON object with fields {fields[0]!r} and "
                                     f"{fields[1]!r}, got {_json_type(record)}")
                rows.append(_row(record, where, fields))
    except UnicodeDecodeError as e:
        raise ValueError(f"dataset {name!r}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return rows


def _parquet_rows(p: pathlib.Path, name: str, fields: _Fields) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"dataset {name!r}: reading Parquet needs pyarrow (install the optional extra: "
                         'pip install -e ".[parquet]"), or convert the file to JSONL') from None
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow's errors for a damaged file vary by version
        raise ValueError(f"dataset {name!r}: cannot read as Parquet: {type(e).__name__}: {e}") from None
    _check_columns(name, table.column_names, fields)
    return [_row(record, f"{name}:row {i}", fields) for i, record in enumerate(table.to_pylist(), start=1)]


def _disk_rows(p: pathlib.Path, name: str, fields: _Fields) -> list[Row]:
    """A directory written by ``Dataset.save_to_disk`` (a ``DatasetDict``'s is refused,
    naming its splits: each split is a directory of its own)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"dataset {name!r} is a directory: reading one written by datasets' save_to_disk "
                         'needs the datasets package (install the optional extra: pip install -e ".[datasets]")'
                         ) from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError... for a directory it did not write
        raise ValueError(f"dataset {name!r}: cannot read as a directory written by datasets' save_to_disk: "
                         f"{type(e).__name__}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"dataset {name!r} holds the splits {', '.join(ds)}: give one split's directory, "
                         f"e.g. {str(p / next(iter(ds), 'train'))!r}")
    return _dataset_rows(ds, name, fields)


def _dataset_rows(ds: Iterable[Mapping[str, object]], name: str, fields: _Fields) -> list[Row]:
    columns = getattr(ds, "column_names", None)  # a datasets.Dataset knows them before its first row
    if isinstance(columns, list):
        _check_columns(name, columns, fields)
    rows = []
    for i, record in enumerate(ds, start=1):
        where = f"{name}:row {i}"
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: expected a dict with fields {fields[0]!r} and {fields[1]!r}, "
                             f"got {type(record).__name__}")
        rows.append(_row(dict(record), where, fields))
    return rows


def _check_columns(name: str, columns: list[str], fields: _Fields) -> None:
    """A field whose top-level column is absent is a file-level error (every row would fail)."""
    for field in fields[:2] if fields[2] else fields[:1]:
        if field not in columns and field.split(".", 1)[0] not in columns:
            raise ValueError(f"dataset {name!r}: no column {field!r} (columns: {', '.join(columns)})")


_MISSING = object()


def _get(record: dict, path: str, where: str) -> Any:
    """``record[path]``, or down a dotted ``path`` through nested dicts. A key
    missing on the way is a ``ValueError`` naming the row and the path."""
    if path in record:
        return record[path]
    value: Any = record
    for depth, key in enumerate(path.split(".")):
        if not isinstance(value, Mapping) or value.get(key, _MISSING) is _MISSING:
            if depth == 0:
                raise ValueError(f"{where}: missing field {path!r} (fields: {', '.join(map(str, record)) or 'none'})")
            parent = ".".join(path.split(".")[:depth])
            has = (f"it has: {', '.join(map(str, value)) or 'nothing'}" if isinstance(value, Mapping)
                   else f"it is {_json_type(value)}")
            raise ValueError(f"{where}: missing field {path!r} (no {key!r} in {parent!r}; {has})")
        value = value[key]
    return value


def _row(record: dict, where: str, fields: _Fields) -> Row:
    prompt_field, answer_field, answer_required = fields
    prompt = _get(record, prompt_field, where)
    if isinstance(prompt, (list, tuple)):
        prompt = _messages(prompt, where, prompt_field)
    elif not isinstance(prompt, str):
        raise ValueError(f"{where}: field {prompt_field!r} must be a string or a list of chat messages, "
                         f"got {_json_type(prompt)}")
    elif not prompt.strip():
        raise ValueError(f"{where}: field {prompt_field!r} is empty")
    if not answer_required:  # the reward reads no answer: what there is, as text, for whoever shows it
        return Row(prompt=prompt, answer=_optional_answer(record, answer_field), where=where, fields=record)
    answer = _get(record, answer_field, where)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer):
        answer = str(answer)
    if not isinstance(answer, str):
        raise ValueError(f"{where}: field {answer_field!r} must be a string or a number, got {_json_type(answer)}")
    if not answer.strip():
        raise ValueError(f"{where}: field {answer_field!r} is empty")
    return Row(prompt=prompt, answer=answer, where=where, fields=record)


def _optional_answer(record: dict, answer_field: str) -> str:
    """The answer field's text when the row has one that is a string or a number, else ""."""
    try:
        answer = _get(record, answer_field, "")
    except ValueError:  # no such field
        return ""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer):
        return str(answer)
    return answer if isinstance(answer, str) else ""


def _messages(prompt: list | tuple, where: str, field: str) -> list[dict[str, object]]:
    """A chat prompt as verl and TRL write it: ``[{"role": ..., "content": ...}, ...]``."""
    if not prompt:
        raise ValueError(f"{where}: field {field!r} is an empty list of chat messages")
    for i, m in enumerate(prompt):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: field {field!r}: message {i} must be an object with a string 'role' and "
                             f"a string 'content', got {m!r:.80}")
    return [dict(m) for m in prompt]


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


class ArithmeticProblems:
    """Integer arithmetic problems, ``"What is 37 + 48? <instruction>"`` -> ``"85"``,
    generated on the fly (nothing downloaded), with a held-out split that
    training never sees.

    Each problem has ``num_operands`` operands, uniform in ``[0, 10**d)``, joined
    by operators drawn from ``ops`` (``+``, ``-``, ``*``; usual precedence).
    ``d`` is ``digits``, or — with ``tail_alpha > 0`` — heavy-tailed per
    problem: ``floor(digits * U**(-1/tail_alpha))`` capped at ``max_digits``
    (U uniform in (0, 1]), so a few problems have much longer answers.

    The split is a function of the expression alone: a problem is held out when
    a hash of its text lands in the first ``eval_fraction`` of the hash space
    (the same in every process and run). Training draws reject held-out
    problems; :meth:`held_out` enumerates them from a fixed seed.
    """

    OPS = "+-*"

    def __init__(self, *, digits: int = 2, num_operands: int = 2, ops: str = "+-", tail_alpha: float = 0.0,
                 max_digits: int = 12, eval_fraction: float = 0.1,
                 instruction: str = "Answer with the number only.") -> None:
        if not 1 <= digits <= max_digits:
            raise ValueError(f"text_arithmetic needs 1 <= digits <= max_digits, got digits={digits}, "
                             f"max_digits={max_digits}")
        if num_operands < 2:
            raise ValueError(f"text_arithmetic needs num_operands >= 2, got {num_operands}")
        if not ops or set(ops) - set(self.OPS):
            raise ValueError(f"text_arithmetic ops must be a non-empty string of {self.OPS!r}, got {ops!r}")
        if tail_alpha < 0:
            raise ValueError(f"text_arithmetic needs tail_alpha >= 0 (0 = off), got {tail_alpha}")
        if not 0 < eval_fraction < 1:
            raise ValueError(f"text_arithmetic needs 0 < eval_fraction < 1, got {eval_fraction}")
        self.digits, self.num_operands, self.ops = digits, num_operands, "".join(sorted(set(ops)))
        self.tail_alpha, self.max_digits, self.eval_fraction = tail_alpha, max_digits, eval_fraction
        self.instruction = instruction

    def is_held_out(self, expr: str) -> bool:
        """Whether ``expr`` belongs to the held-out split (stable across processes)."""
        h = int.from_bytes(hashlib.blake2b(expr.encode(), digest_size=8).digest(), "big")
        return h < self.eval_fraction * 2**64

    def question(self, expr: str) -> str:
        return f"What is {expr}? {self.instruction}".rstrip()

    def sample(self, rng: random.Random) -> Row:
        """One training problem drawn with ``rng`` (never a held-out one)."""
        for _ in range(1000):
            expr, value = self._draw(rng)
            if not self.is_held_out(expr):
                return Row(prompt=self.question(expr), answer=str(value), where="text_arithmetic:train")
        raise ValueError(f"text_arithmetic: no training problem in 1000 draws; the problem space "
                         f"(digits={self.digits}, num_operands={self.num_operands}, ops={self.ops!r}) is too "
                         f"small for eval_fraction={self.eval_fraction}")

    def held_out(self, n: int) -> list[Row]:
        """The first ``n`` distinct held-out problems from a fixed seed: the same
        on every call and in every process. Fewer when the problem space holds
        fewer than ``n`` held-out problems."""
        rng, seen = random.Random("asyncrl/text_arithmetic/eval"), set()
        out: list[Row] = []
        for _ in range(max(1000, 200 * n)):
            if len(out) == n:
                break
            expr, value = self._draw(rng)
            if expr not in seen and self.is_held_out(expr):
                seen.add(expr)
                out.append(Row(prompt=self.question(expr), answer=str(value),
                               where=f"text_arithmetic:eval {len(out) + 1}"))
        return out

    def _num_digits(self, rng: random.Random) -> int:
        if self.tail_alpha == 0:
            return self.digits
        u = 1.0 - rng.random()  # in (0, 1]
        return min(self.max_digits, int(math.floor(self.digits * u ** (-1.0 / self.tail_alpha))))

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        d = self._num_digits(rng)
        operands = [rng.randrange(10**d) for _ in range(self.num_operands)]
        ops = [rng.choice(self.ops) for _ in range(self.num_operands - 1)]
        expr = " ".join([str(operands[0])] + [f"{op} {x}" for op, x in zip(ops, operands[1:])])
        return expr, _evaluate(operands, ops)


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """``operands`` joined by ``ops`` with ``*`` before ``+``/``-`` (no eval())."""
    terms, signs = [operands[0]], []
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(op)
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = total + term if sign == "+" else total - term
    return total
