"""The README's quick start is what CI runs: `.ci/run` makes a new virtual
environment and runs the README's test command in it, word for word."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_the_quick_start_is_exactly_two_commands_install_and_run_then_install_and_test():
    run, test = _quick_start_commands()
    assert run.startswith("pip install ") and "python -m actors.launch fully_async.yaml" in run
    assert test.startswith("pip install ") and test.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command_verbatim_in_a_new_virtual_environment():
    script = (ROOT / ".ci" / "run").read_text()
    _, test = _quick_start_commands()
    lines = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert test in lines
    tested = lines.index(test)
    # after the tests only checks run, nothing installed: the README's command is the whole setup
    assert all(not re.match(r"(pip|python3? -m pip) ", line) for line in lines[tested + 1:]), lines[tested + 1:]
    venv = next(i for i, line in enumerate(lines) if re.match(r"python3? -m venv ", line))
    activate = next(i for i, line in enumerate(lines) if re.match(r"(source|\.) \S+/bin/activate\"?$", line))
    assert venv < activate < tested
    assert "mktemp -d" in script  # a new directory, never a venv left from an earlier run
