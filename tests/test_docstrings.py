"""Library docstrings say how the code works, not what it measured once.

A measured figure goes stale with the next machine, driver or commit; its home is
``docs/benchmarks.md`` and ``bench/results/``, where it sits beside its command and machine.
The library is every package but ``bench/`` and ``tests/``: ``actors``, ``contracts``,
``loop``, ``policies``, ``sync``, ``transfer_queue`` and ``tools``. In its docstrings (module,
class, function, and the string under a config field), a line fails on:

1. **A commit hash**: a token of 7-40 lowercase hex digits with at least one digit and one
   letter, standing alone (not inside a longer word, not after ``0x`` or a dot). A hex
   constant is written ``0x...`` and never matches, a number (``1234567``) has no letter and a
   word (``deadbeef``, ``facade``) no digit.
2. **A timing or throughput with units**: a number (``7``, ``7.3``, ``~7``, ``7-9``) followed
   by a time unit (``ns``, ``us``, ``µs``, ``ms``, ``s``, ``sec``, ``seconds`` and its
   ``milli``/``micro``/``nano`` forms, ``min``, ``minutes``, ``hours``) or a rate (``tokens/s``, ``tok/s``, ``samples/s``, ``steps/s``,
   ``rows/s``, ``KB/s`` to ``TB/s``, ``FLOPS``, ``% MFU``). A setting is written as its key with
   the unit in the key's name (``reward_timeout_s``, 30 by default), never as "30 s", so every
   such figure in prose is a measurement.
3. **A machine with a figure**: a sentence that names a lent machine or a lease (``H100``,
   ``H200``, ``A100``, ``B200``, ``lease``, ``lent``) and holds a ratio or share (``1.4x``,
   ``39%``) or any figure of rule 2: "1.4x faster on an H100" is a measurement too.

A failure names ``file:line`` and the text; move the figure to ``docs/benchmarks.md`` (or
drop it) and say "see docs/benchmarks.md" where the reader needs to know it was measured.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("actors", "contracts", "loop", "policies", "sync", "transfer_queue", "tools")

COMMIT = re.compile(r"(?<![\w.])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?!\w)")
_NUMBER = r"(?<![\w.])~?\d+(?:[.,]\d+)*(?:\s?[-–]\s?~?\d+(?:\.\d+)?)?"
_TIME = r"(?:ns|us|µs|ms|s|secs?|(?:nano|micro|milli)?seconds?|mins?|minutes?|hours?)(?![\w/])"
_RATE = r"(?:[kKM]\s?)?(?:(?:tokens?|tok|samples?|steps?|rows?)/s|[KMGT]i?B/s|T?FLOPS|%\s?MFU)"
TIMING = re.compile(_NUMBER + r"\s?(?:" + _TIME + "|" + _RATE + ")")
MACHINE = re.compile(r"\b(?:[HABL]\d{2,3}|lease[sd]?|lent)\b")
RATIO = re.compile(_NUMBER + r"(?:x|\s?%)(?!\w)")


def library_files() -> list[pathlib.Path]:
    return sorted(p for pkg in LIBRARY for p in (ROOT / pkg).rglob("*.py"))


def docstrings(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every string statement: docstrings and the strings under fields."""
    return [(node.lineno, node.value.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)]


def _sentences(text: str) -> list[tuple[int, str]]:
    """(offset, sentence) over a text, a sentence ending at '. ', ': ' or a blank line."""
    out, start = [], 0
    for m in re.finditer(r"\.\s|;\s|\n\s*\n", text):
        out.append((start, text[start:m.end()]))
        start = m.end()
    out.append((start, text[start:]))
    return out


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line offset within the text, rule, what matched) for each figure the rules forbid."""
    found = []
    for m in COMMIT.finditer(text):
        found.append((text.count("\n", 0, m.start()), "commit hash", m.group()))
    for m in TIMING.finditer(text):
        found.append((text.count("\n", 0, m.start()), "timing with units", m.group()))
    for start, sentence in _sentences(text):
        if (machine := MACHINE.search(sentence)) and (m := RATIO.search(sentence)):
            found.append((text.count("\n", 0, start + m.start()), "machine with a figure",
                          f"{m.group()} ({machine.group()})"))
    return found


def test_the_rules_catch_measured_figures_and_hashes_and_pass_plain_prose():
    assert [r for _, r, _ in findings("A full push takes 7.3 ms on an H100.")] == ["timing with units"]
    assert [r for _, r, _ in findings("Measured at c522395.")] == ["commit hash"]
    assert [r for _, r, _ in findings("It runs 1.4x faster on one H200.")] == ["machine with a figure"]
    assert [r for _, r, _ in findings("~40k tokens/s in the loop")] == ["timing with units"]
    assert [r for _, r, _ in findings("a step of 0.4-0.8 s")] == ["timing with units"]
    assert findings("mask 0x7fffffff, 1234567 rows, deadbeef, 2 samples a step, 3x the budget") == []
    assert findings("``reward_timeout_s`` (seconds, 30 by default); bf16 on an H100") == []
    assert findings("the sha256 of the file (64 hex digits) and version 2.11") == []
    assert [r for _, r, _ in findings("waits 30 milliseconds")] == ["timing with units"]
    assert findings("tens of microseconds a message; about 80 times faster") == []


def test_no_library_docstring_carries_a_measurement_or_a_commit_hash():
    bad = []
    for path in library_files():
        source = path.read_text()
        for first, text in docstrings(source):
            for offset, rule, what in findings(text):
                line = first + offset
                bad.append(f"{path.relative_to(ROOT)}:{line}: {rule}: {what!r}: "
                           f"{source.splitlines()[line - 1].strip()[:100]}")
    assert not bad, ("measured figures and commit hashes belong in docs/benchmarks.md "
                     "(tests/test_docstrings.py says the rule):\n" + "\n".join(bad))
