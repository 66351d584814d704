"""Joining a Ray cluster (``runtime.address``): what the runtime checks before
``ray.init`` and what a failed attempt leaves behind (nothing). Loopback only: a
refused port, a port of the test's own that accepts and never answers, and the
GCS of a cluster this test starts. The command-line side (one line, exit 2, no
run directory) is in ``tests/test_launch_errors.py``."""

from __future__ import annotations

import os
import threading
import time

import pytest

from actors.ray_address import _check_gcs, _probe_ray_address
from actors.runtime import make_runtime
from tests.helpers import free_port, silent_listener

pytestmark = pytest.mark.timeout(60)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def child_pids() -> set[int]:
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("case", ["refused", "silent", "auto_none"])
def test_a_failed_join_is_one_line_within_the_timeout_and_leaves_nothing_running(case, request):
    import ray

    assert not ray.is_initialized()
    listener = silent_listener()
    address = {"refused": f"127.0.0.1:{free_port()}", "silent": f"127.0.0.1:{listener.getsockname()[1]}",
               "auto_none": "auto"}[case]
    if case == "auto_none":
        request.getfixturevalue("no_ray_cluster_here")
    threads, tasks, children = set(threading.enumerate()), os_threads(), child_pids()
    runtime = make_runtime("ray", address=address, connect_timeout_s=0.3)
    start = time.monotonic()
    with listener, pytest.raises(ConnectionError) as info:
        runtime.connect()
    took = time.monotonic() - start
    message = str(info.value)
    assert "\n" not in message and "runtime.address" in message and address in message
    assert "check" in message or "start one with" in message  # says what to check
    assert took < 0.3 + 2, took
    assert not ray.is_initialized()
    assert set(threading.enumerate()) == threads and os_threads() == tasks and child_pids() == children


@pytest.mark.ray
def test_the_probe_lets_a_real_gcs_through_at_once():
    """The checks must never refuse a live cluster: a GCS answers the HTTP/2 preface
    and gives its cluster id to a process holding the token (ray.init made one here).
    Probed on loopback, the only interface the tests' GCS listens on (tests/conftest.py)."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
        assert host == "127.0.0.1"
        start = time.monotonic()
        _probe_ray_address(f"127.0.0.1:{port}", timeout_s=5)
        _check_gcs(f"127.0.0.1:{port}", "runtime.address")
        assert time.monotonic() - start < 2
    finally:
        ray.shutdown()
