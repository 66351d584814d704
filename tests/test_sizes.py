"""Small rooms: no source file outside ``bench/`` and ``tests/`` is over
MAX_FILE_LINES lines, and no function or method in one is over
MAX_FUNCTION_LINES, counted from its first decorator to its last line. A file
that grows past that is asking to be split along a seam (STYLE.md, habit 13);
a function that long, into the steps it takes.

A failure names each offender as ``path:line name N lines``.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
OUTSIDE = ("bench", "tests")  # benchmarks and tests: long scripts and tables by nature


def _sources() -> list[pathlib.Path]:
    """Every .py file of the checkout but those under OUTSIDE and hidden folders."""
    return sorted(p for p in ROOT.rglob("*.py")
                  if p.relative_to(ROOT).parts[0] not in OUTSIDE
                  and not any(part.startswith(".") for part in p.relative_to(ROOT).parts))


def _functions(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function and method in ``tree``, nested ones too."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                assert child.end_lineno is not None
                found.append((prefix + child.name, first, child.end_lineno - first + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_the_size_check_sees_the_library() -> None:
    names = {str(p.relative_to(ROOT)) for p in _sources()}
    assert {"transfer_queue/controller.py", "actors/runtime/process.py", "sync/device_delta.py"} <= names
    assert not any(n.startswith(("bench/", "tests/")) for n in names)


def test_no_source_file_is_over_500_lines() -> None:
    long = []
    for path in _sources():
        n = len(path.read_text().splitlines())
        if n > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT)}:1 (the file) {n} lines")
    assert not long, f"over {MAX_FILE_LINES} lines: split along a seam:\n" + "\n".join(long)


def test_no_function_is_over_80_lines() -> None:
    long = []
    for path in _sources():
        for name, line, n in _functions(ast.parse(path.read_text(), str(path))):
            if n > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{line} {name} {n} lines")
    assert not long, f"over {MAX_FUNCTION_LINES} lines (first decorator to end): split it:\n" + "\n".join(long)


def test_the_counts_are_of_decorators_to_end() -> None:
    tree = ast.parse("class A:\n    @staticmethod\n    @property\n    def f():\n        return 1\n")
    assert _functions(tree) == [("A.f", 2, 4)]
