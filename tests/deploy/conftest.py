from __future__ import annotations

import contextlib
import shutil
import tempfile
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


@contextlib.contextmanager
def two_node_cluster(num_cpus_per_node: int = 2, **second_node: Any) -> Iterator[Any]:
    """Two raylets and a GCS of our own, with this process connected; every process ends after.
    `second_node` adds to the second node's `ray start` arguments (labels, resources, num_gpus).

    A `ray.cluster_utils.Cluster` writes its address to `<RAY_TMPDIR>/ray/ray_current_cluster`,
    where a plain `ray.init()` elsewhere on this machine would find it and join; an own
    RAY_TMPDIR (short, since Ray's socket paths live under it) keeps the cluster to its test.
    """
    import ray
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="ssmn-", dir="/tmp")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", temp_dir)
        env.delenv("RAY_ADDRESS", raising=False)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": num_cpus_per_node,
                "include_dashboard": False,
                "dashboard_agent_listen_port": None,  # any free port, as the Cluster picks for other nodes
            },
        )
        try:
            cluster.add_node(num_cpus=num_cpus_per_node, **second_node)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
