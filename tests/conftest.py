"""Suite-wide collection rules."""

from __future__ import annotations

import signal

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a vLLM test starts an AsyncLLM (~50 s on 2 CPU cores); the engine contract's
    # class-wide 60 s is the built-in engine's: the item's own marker is the closest
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.timeout(600))


@pytest.fixture(scope="module")
def wide_heads() -> bool:
    """The engine contract's tiny models with head_dim 64 (override with True in a
    module whose engine needs it, as vLLM's CPU build does)."""
    return False


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt) for a test that sends
    SIGINT: a suite started in the background by a non-interactive shell
    inherits SIGINT ignored, and such a test would then wait forever."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
