from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One local Ray per test module (ray.init takes seconds); ended when the module is done."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def registry(ray_cluster: None) -> Iterator[Any]:
    """The fake actors' event log (tests/deploy/fakes.py), fresh for each test."""
    import ray

    from tests.deploy.fakes import REGISTRY_NAME, REGISTRY_NAMESPACE, Registry

    actor = Registry.options(name=REGISTRY_NAME, namespace=REGISTRY_NAMESPACE).remote()
    yield actor
    ray.kill(actor)
