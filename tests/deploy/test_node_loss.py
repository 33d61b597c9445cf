"""A node lost for good (its raylet and everything on it killed), with fake actors: the workers
it held come back where Ray re-places their bundles, each given the store of the node it now
runs on, the lost node's store leaves the roster, and the gateway hears the new addresses. The
decode pool is kept to the nodes with a `decode_host` resource: the second node, then a spare
added before the loss (the head has none)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from deploy.launcher import run_cluster
from deploy.placement import HEAD_NODE_RESOURCE
from tests.deploy.conftest import two_node_cluster
from tests.deploy.fakes import FAKE_CLASSES, REGISTRY_NAME, REGISTRY_NAMESPACE, Registry
from tests.deploy.helpers import small_config, wait_until

DECODE_HOST = {"decode_host": 1.0}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    with two_node_cluster(node_resources=DECODE_HOST) as cluster:
        yield cluster


@pytest.fixture
def registry(ray_cluster: Cluster) -> Iterator[Any]:
    """The fakes' event log, on the head: it must outlive the node the test kills."""
    actor = Registry.options(
        name=REGISTRY_NAME, namespace=REGISTRY_NAMESPACE, resources={HEAD_NODE_RESOURCE: 0.001}
    ).remote()
    yield actor
    ray.kill(actor)


def _decode(status: dict[str, Any]) -> dict[str, Any]:
    (row,) = status["pools"]["decode"]["workers"]
    return row  # type: ignore[no-any-return]


def test_a_lost_nodes_decode_worker_comes_back_on_a_spare_node_beside_its_store(ray_cluster, registry):
    config = small_config(decode={"resources": DECODE_HOST}, health={"start_timeout_s": 120})
    lost = ray_cluster.list_all_nodes()[1]
    with run_cluster(config, actor_classes=FAKE_CLASSES) as cluster:
        before = _decode(cluster.status())
        assert before["node_id"] == lost.node_id
        spare = ray_cluster.add_node(num_cpus=1, resources=DECODE_HOST)
        ray_cluster.remove_node(lost, allow_graceful=False)

        def moved() -> dict[str, Any] | None:
            status = cluster.status()
            row = _decode(status)
            return status if row["healthy"] and row["node_id"] == spare.node_id else None

        status = wait_until(moved, timeout_s=120, what="the decode worker healthy on the spare node")
        assert _decode(status)["restarts"] >= 1
        stores = {row["node_id"]: row["address"] for row in status["stores"]}
        assert lost.node_id not in stores and spare.node_id in stores, status["stores"]
        events = ray.get(registry.get_events.remote())
        last_construct = [e for e in events if e[:2] == ("construct", "decode")][-1]
        assert last_construct[2] == stores[spare.node_id] and last_construct[4] == spare.node_id
        told = [e for e in events if e[0] == "update_workers"][-1]
        assert told[2] == [_decode(status)["address"]]
