"""A local Ray for the actor tests that need real actors (one per test module)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_local(request):
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
                 namespace=f"test-{request.module.__name__.rpartition('.')[2]}")
    yield ray
    if started:
        ray.shutdown()
