"""The tools (``tools/``, apart from the library) stay runnable as modules from a checkout."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tool", ["tools.warmstart", "tools.rl_smoke", "tools.sft_text"])
def test_each_tool_runs_as_a_module(tool):
    res = subprocess.run([sys.executable, "-m", tool, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout


def test_the_builtin_tasks_use_the_tokenizer_the_builtin_model_ships():
    from actors.models import BUILTIN_MODEL_DIR, load_tokenizer
    from policies.tasks import build_symbol_tokenizer

    assert build_symbol_tokenizer().get_vocab() == load_tokenizer(BUILTIN_MODEL_DIR).get_vocab()
