"""The layering of DESIGN.md, checked on the source: no import cycle between
top-level packages, and each package imports only what sits below it.

    contracts                       imports no project package
    loop                            imports no project package
    transfer_queue, sync            import only contracts and loop (and not each other)
    policies                        never imports actors
    actors                          imports policies only in the composition root
                                    (actors/launch.py, actors/config.py, and actors/export.py,
                                    which reads a run's config), which nothing else imports
    bench, tools, tests             consumers: import anything, imported by no library package

Every ``import`` is counted wherever it sits: module level, inside a function,
under ``if TYPE_CHECKING``; ``import a.b``, ``from a.b import c`` and relative
imports alike.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("actors", "contracts", "loop", "policies", "sync", "transfer_queue")
CONSUMERS = ("bench", "tools", "tests")
COMPOSITION_ROOT = ("actors.launch", "actors.config", "actors.export", "actors.evaluate", "actors.cli", "actors.run", "actors.wiring",
                    "actors.training", "actors.resume", "actors.notebook_api")

#: What each low package may import (besides itself).
ALLOWED = {
    "contracts": set(),
    "loop": set(),
    "transfer_queue": {"contracts", "loop"},
    "sync": {"contracts", "loop"},
}


@dataclasses.dataclass(frozen=True)
class Edge:
    """One import statement: module ``src`` imports module ``dst`` at ``file:line``."""

    src: str
    dst: str
    file: str
    line: int

    @property
    def src_pkg(self) -> str:
        return self.src.split(".")[0]

    @property
    def dst_pkg(self) -> str:
        return self.dst.split(".")[0]

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.src} imports {self.dst})"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str, root: pathlib.Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: pathlib.Path, root: pathlib.Path, packages: tuple[str, ...]) -> list[Edge]:
    """Every import in ``path`` of a module in ``packages``, resolved to the
    module imported (``from a import b`` names ``a.b`` when that is a module)."""
    src = module_name(path, root)
    is_pkg = path.name == "__init__.py"
    here = src.split(".") if is_pkg else src.split(".")[:-1]
    rel = str(path.relative_to(root))
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if _is_module(f"{module}.{a.name}", root) else module
                       for a in node.names]
        else:
            continue
        for dst in dict.fromkeys(targets):
            if dst.split(".")[0] in packages:
                out.append(Edge(src, dst, rel, node.lineno))
    return out


def project_edges(root: pathlib.Path, packages: tuple[str, ...]) -> list[Edge]:
    edges = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            edges.extend(imports_of(path, root, packages))
    return edges


def package_graph(edges: list[Edge]) -> dict[str, dict[str, list[Edge]]]:
    """``{src_pkg: {dst_pkg: [the edges that make it]}}`` between different packages."""
    graph: dict[str, dict[str, list[Edge]]] = {}
    for e in edges:
        if e.src_pkg != e.dst_pkg:
            graph.setdefault(e.src_pkg, {}).setdefault(e.dst_pkg, []).append(e)
    return graph


def find_cycles(graph: dict[str, dict[str, list]] | dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle ``[a, b, ..., a]``, each once, starting at its
    smallest package (the package graph is a handful of nodes: a plain search)."""
    succ = {n: sorted(d) for n, d in graph.items()}
    cycles = []

    def walk(start: str, path: list[str]) -> None:
        for w in succ.get(path[-1], []):
            if w == start:
                cycles.append(path + [start])
            elif w > start and w not in path:
                walk(start, path + [w])

    for start in sorted(set(succ) | {m for ms in succ.values() for m in ms}):
        walk(start, [start])
    return cycles


def describe(cycle: list[str], graph: dict[str, dict[str, list[Edge]]]) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        lines.append(f"  {a} -> {b}:")
        lines.extend(f"    {e}" for e in graph[a][b])
    return "\n".join(lines)


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return project_edges(ROOT, LIBRARY + CONSUMERS)


def _fail(what: str, bad: list[Edge]) -> None:
    if bad:
        pytest.fail(what + ":\n" + "\n".join(f"  {e}" for e in bad))


# --- the checker itself ------------------------------------------------------------------


def test_the_cycle_finder_names_every_cycle_of_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "a"], ["a", "b", "c", "a"], ["e", "f", "e"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_a_cycle_through_a_function_local_relative_import_is_found_and_located(tmp_path):
    (tmp_path / "low").mkdir()
    (tmp_path / "high").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("")
    (tmp_path / "low" / "util.py").write_text("import os\n\n\ndef f():\n    from high.thing import g\n    return g\n")
    (tmp_path / "high" / "__init__.py").write_text("from . import thing\n")
    (tmp_path / "high" / "thing.py").write_text("from low import util\n\n\ndef g():\n    return util\n")
    found = project_edges(tmp_path, ("low", "high"))
    assert Edge("high", "high.thing", "high/__init__.py", 1) in found  # relative, resolved to the module
    graph = package_graph(found)
    (cycle,) = find_cycles(graph)
    text = describe(cycle, graph)
    assert cycle == ["high", "low", "high"]
    assert "high/thing.py:1 (high.thing imports low.util)" in text
    assert "low/util.py:5 (low.util imports high.thing)" in text


# --- the project --------------------------------------------------------------------------


def test_no_import_cycle_between_top_level_packages(edges):
    graph = package_graph(edges)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between packages:\n" + "\n".join(describe(c, graph) for c in cycles)


def test_contracts_loop_sync_and_transfer_queue_import_only_what_sits_below_them(edges):
    _fail("a low package imports above itself", [
        e for e in edges if e.src_pkg in ALLOWED and e.dst_pkg != e.src_pkg and e.dst_pkg not in ALLOWED[e.src_pkg]])


def test_policies_never_import_actors(edges):
    _fail("policies/ imports actors/ (the composition root injects what policies need)",
          [e for e in edges if e.src_pkg == "policies" and e.dst_pkg == "actors"])


def test_no_library_package_imports_a_consumer(edges):
    _fail("library code imports bench/, tools/ or tests/",
          [e for e in edges if e.src_pkg in LIBRARY and e.dst_pkg in CONSUMERS])


def test_nothing_imports_the_composition_root(edges):
    def is_root(module: str) -> bool:
        return any(module == r or module.startswith(r + ".") for r in COMPOSITION_ROOT)

    _fail("library code imports actors.launch / actors.config (only bench/, tools/ and tests/ may)",
          [e for e in edges if is_root(e.dst) and not is_root(e.src) and e.src_pkg not in CONSUMERS])


def test_only_the_composition_root_of_actors_imports_policies(edges):
    """Actors get the policy math (loss, advantages, task, resume budget) injected."""
    _fail("an actor module imports policies/ (inject it from actors/launch.py instead)", [
        e for e in edges if e.src_pkg == "actors" and e.dst_pkg == "policies"
        and not any(e.src == r for r in COMPOSITION_ROOT)])
