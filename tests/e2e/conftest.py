"""Fixtures every e2e module shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray per module (2 cores: small num_cpus), shut down when the module ends."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
