"""Two Ray nodes on one machine: STRICT_SPREAD places one replica per node, each node gets its
own store, and each worker is given its own node's store address."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from deploy.launcher import run_cluster
from tests.deploy.conftest import two_node_cluster
from tests.deploy.fakes import FAKE_CLASSES
from tests.deploy.helpers import small_config


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    """Two nodes instead of conftest's one (the registry fixture runs on this one)."""
    with two_node_cluster() as cluster:
        yield cluster


def test_strict_spread_puts_a_replica_and_a_store_on_each_node(registry):
    config = small_config(prefill={"replicas": 2, "placement": "STRICT_SPREAD"}, decode={"num_cpus": 0.25})
    with run_cluster(config, actor_classes=FAKE_CLASSES) as cluster:
        status = cluster.status()
        assert status["healthy"]
        events = ray.get(registry.get_events.remote())
        stores = {e[3]: e[2] for e in events if e[:2] == ("start", "store")}
        prefill_nodes = [e[4] for e in events if e[:2] == ("construct", "prefill")]
        assert len(stores) == 2 and sorted(prefill_nodes) == sorted(stores)
        for event in events:
            if event[0] == "construct":
                _, kind, store_address, _, node_id = event
                assert store_address == stores[node_id], f"{kind} on {node_id} got another node's store"
        head = ray.get_runtime_context().get_node_id()
        gateway_node = next(e[3] for e in events if e[:2] == ("start", "gateway"))
        assert gateway_node == head
        assert len(status["stores"]) == 2
