"""Where text prompts come from: rows read from a file (JSONL, or Parquet when
pyarrow is installed), or the built-in generator of arithmetic problems.

A row is a prompt (text shown to the model) and its ground-truth answer (text
the reward compares against), plus where it came from (``file:line``) so that
every error names it. Rows are validated on load: a bad one is an error naming
the file, the line (1-based; ``row N`` for Parquet) and the field — never
skipped.

JSONL: one JSON object per line; blank lines are ignored. The prompt field must
be a non-empty string; the answer field a non-empty string or a number (turned
into its text: ``42`` -> ``"42"``). Other fields are ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import random

import msgspec

__all__ = ["ArithmeticProblems", "Row", "load_rows"]


class Row(msgspec.Struct, frozen=True):
    """One validated example: ``prompt`` and ``answer`` text, ``where`` it was read (``file:line``)."""

    prompt: str
    answer: str
    where: str


def load_rows(path: str | os.PathLike, *, prompt_field: str = "prompt", answer_field: str = "answer") -> list[Row]:
    """Every row of the JSONL or Parquet (``.parquet``/``.pq``) file at ``path``
    (absolute, or relative to the current directory), in file order.

    Raises ``ValueError`` naming the file — and the line and field where one is
    at fault — when the file is missing, empty, not JSON, or a row lacks a
    field or has one of the wrong type."""
    p = pathlib.Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"dataset {str(path)!r}: no such file (looked for {p.absolute()})")
    if p.suffix in (".parquet", ".pq"):
        rows = _parquet_rows(p, str(path), prompt_field, answer_field)
    else:
        rows = _jsonl_rows(p, str(path), prompt_field, answer_field)
    if not rows:
        raise ValueError(f"dataset {str(path)!r}: the file has no rows")
    return rows


def _jsonl_rows(p: pathlib.Path, name: str, prompt_field: str, answer_field: str) -> list[Row]:
    rows = []
    try:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{name}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno}); "
                                     "expected one JSON object per line") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{where}: expected a JSON object with fields {prompt_field!r} and "
                                     f"{answer_field!r}, got {_json_type(record)}")
                rows.append(_row(record, where, prompt_field, answer_field))
    except UnicodeDecodeError as e:
        raise ValueError(f"dataset {name!r}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return rows


def _parquet_rows(p: pathlib.Path, name: str, prompt_field: str, answer_field: str) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"dataset {name!r}: reading Parquet needs pyarrow (install the optional extra: "
                         'pip install -e ".[parquet]"), or convert the file to JSONL') from None
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow's errors for a damaged file vary by version
        raise ValueError(f"dataset {name!r}: cannot read as Parquet: {type(e).__name__}: {e}") from None
    for field in (prompt_field, answer_field):
        if field not in table.column_names:
            raise ValueError(f"dataset {name!r}: no column {field!r} (columns: {', '.join(table.column_names)})")
    prompts, answers = table.column(prompt_field).to_pylist(), table.column(answer_field).to_pylist()
    return [_row({prompt_field: q, answer_field: a}, f"{name}:row {i}", prompt_field, answer_field)
            for i, (q, a) in enumerate(zip(prompts, answers), start=1)]


def _row(record: dict, where: str, prompt_field: str, answer_field: str) -> Row:
    for field in (prompt_field, answer_field):
        if field not in record:
            raise ValueError(f"{where}: missing field {field!r} (fields: {', '.join(map(str, record)) or 'none'})")
    prompt, answer = record[prompt_field], record[answer_field]
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: field {prompt_field!r} must be a string, got {_json_type(prompt)}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer):
        answer = str(answer)
    if not isinstance(answer, str):
        raise ValueError(f"{where}: field {answer_field!r} must be a string or a number, got {_json_type(answer)}")
    for field, value in ((prompt_field, prompt), (answer_field, answer)):
        if not value.strip():
            raise ValueError(f"{where}: field {field!r} is empty")
    return Row(prompt=prompt, answer=answer, where=where)


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
        rng, seen, out = random.Random("asyncrl/text_arithmetic/eval"), set(), []
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
