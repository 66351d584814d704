"""Tests that need an optional package skip, naming the extra that installs it."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest


def installed(module: str) -> bool:
    """Whether ``module`` (dotted names too) is installed, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is absent
        return False


def reason(module: str, extra: str, also: str = "") -> str:
    return f"{module} is not installed: pip install -e \".[{extra}]\"" + (f" ({also})" if also else "")


def needs(module: str, extra: str, *, also: str = "") -> ModuleType:
    """Import ``module``, or skip the test (or module) naming the extra that installs it."""
    if not installed(module):
        pytest.skip(reason(module, extra, also), allow_module_level=True)
    return importlib.import_module(module)


def needs_mark(module: str, extra: str) -> pytest.MarkDecorator:
    """A ``skipif`` mark for a test that needs ``module``, naming its extra."""
    return pytest.mark.skipif(not installed(module), reason=reason(module, extra))
