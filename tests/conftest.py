"""Suite-wide collection rules and the fixtures that several test modules share
(plain helper functions are in tests/helpers.py)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

# the helpers assert as the test modules they came from did: with pytest's messages
pytest.register_assert_rewrite("tests.helpers")

# Network tests stay on loopback, Ray's included. Ray takes 127.0.0.1 as a node's IP (and
# its GCS, raylets, object managers and workers then listen on loopback only) where it
# holds multi-node clusters to be off, as on macOS; elsewhere it takes the interface
# address, and turns an explicit 127.0.0.1 (``ray.init(_node_ip_address=...)``) into
# that address too. Set before any test imports ray, and inherited by every process
# Ray and the tests start; ``ray.cluster_utils.Cluster``'s nodes on this machine still
# join one another (only ``ray start --address`` refuses to).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
if "ray._private.ray_constants" in sys.modules:  # imported before this file: read at call time
    sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False


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


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, wide_heads: bool) -> dict[str, tuple[str, object]]:
    """The engine contract's tiny checkpoints: family -> (checkpoint dir, HF model); plus
    "<family>-b": other weights, same shapes (tests/engine_contract.py builds them)."""
    from tests.engine_contract import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny_models"), wide_heads)


@pytest.fixture
def make_update():
    """What the engine contract hands ``update_weights``: a full sync manifest, the real
    path (checked against the engine's host copy). A module whose engine takes
    ``FullWeights`` as they are overrides it."""
    import torch

    from sync import WeightSender

    return lambda version, state: WeightSender(mode="full", dtype=torch.float32).encode(state, version)


@pytest.fixture(scope="module")
def ray_num_cpus() -> int:
    """The CPUs ``ray_cluster`` offers (override in a module whose actors need more)."""
    return 2


@pytest.fixture(scope="module")
def ray_cluster(ray_num_cpus: int):
    """A local Ray cluster for the module's tests (skipped without Ray), shut down after
    them; a cluster already running in this process is used and left running."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=ray_num_cpus, include_dashboard=False, log_to_driver=False)
        assert ray.util.get_node_ip_address() == "127.0.0.1"  # loopback only (see the top)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def no_ray_cluster_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Ray's ``auto`` finds when no cluster runs on this machine. Other processes
    on a shared machine may run Ray, so its two discoveries (the address file a
    ``ray start`` writes, and Ray processes found by ``ps``) are made to find none."""
    import ray._private.services as services

    def none_found() -> frozenset:
        return frozenset()

    none_found.cache_clear = lambda: None  # ray.init / ray.shutdown clear this cache
    monkeypatch.setattr(services, "find_gcs_addresses", none_found)
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt) for a test that sends
    SIGINT: a suite started in the background by a non-interactive shell
    inherits SIGINT ignored, and such a test would then wait forever."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
