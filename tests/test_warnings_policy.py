"""The suite's warning filters (pyproject.toml): the project's own warnings are
errors; a third-party package's warnings, at import or compile time, never fail a test."""

from __future__ import annotations

import warnings

import pytest


def test_a_warning_from_a_project_module_fails_the_test():
    for module in ("actors.launch", "sync", "transfer_queue.rpc", "tests.test_loop"):
        with pytest.raises(RuntimeWarning, match="ours"):
            warnings.warn_explicit("ours", RuntimeWarning, f"/{module.replace('.', '/')}.py", 1, module=module)


def test_a_warning_from_this_test_module_fails_the_test():
    with pytest.raises(RuntimeWarning):
        warnings.warn("raised here", RuntimeWarning)


def test_a_syntax_warning_while_a_third_party_package_compiles_does_not_fail_the_test(tmp_path):
    # what megatron-core installed with --no-compile does on Python 3.12: an invalid escape
    # sequence is a SyntaxWarning when its source compiles at import (a DeprecationWarning on 3.11)
    source = tmp_path / "site-packages" / "thirdparty" / "mod.py"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # record it here, whatever the suite's filters say of it
        compile('pattern = "\\d+"\n', str(source), "exec")
    assert seen, "the invalid escape no longer warns: this test shows nothing"
    compile('pattern = "\\d+"\n', str(source), "exec")  # under the suite's filters: no error
    warnings.warn_explicit("third party", SyntaxWarning, str(source), 1)


def test_a_runtime_warning_from_a_third_party_module_does_not_fail_the_test():
    warnings.warn_explicit("third party", RuntimeWarning, "/x/site-packages/numpy/core.py", 1, module="numpy.core")
