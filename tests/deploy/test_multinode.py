"""Two Ray nodes on one machine: STRICT_SPREAD places one replica per node; a pool's
`node_labels`, custom `resources` and fractional `num_gpus` put it where they say; each node that
gets a worker gets its own store, and each worker is given its own node's store address."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from deploy.launcher import ClusterError, run_cluster
from tests.deploy.conftest import two_node_cluster
from tests.deploy.fakes import FAKE_CLASSES
from tests.deploy.helpers import is_dead_controller, small_config

# The second node is the "gpu" one: one (logical) GPU and two units of a custom resource.
GPU_NODE = {"labels": {"node-type": "gpu"}, "resources": {"decode_slot": 2}, "num_gpus": 1}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    """Two nodes instead of conftest's one (the registry fixture runs on this one)."""
    with two_node_cluster(**GPU_NODE) as cluster:
        yield cluster


def _check_each_worker_got_its_nodes_store(events: list[tuple[Any, ...]]) -> dict[str, str]:
    """Node id -> its store's address, after checking every worker was given its own node's store."""
    stores = {e[3]: e[2] for e in events if e[:2] == ("start", "store")}
    for event in events:
        if event[0] == "construct":
            _, kind, store_address, _, node_id, _ = event
            assert store_address == stores[node_id], f"{kind} on {node_id} got another node's store"
    return stores


def test_strict_spread_puts_a_replica_and_a_store_on_each_node(registry):
    config = small_config(prefill={"replicas": 2, "placement": "STRICT_SPREAD"}, decode={"num_cpus": 0.25})
    with run_cluster(config, actor_classes=FAKE_CLASSES) as cluster:
        status = cluster.status()
        assert status["healthy"]
        events = ray.get(registry.get_events.remote())
        stores = _check_each_worker_got_its_nodes_store(events)
        prefill_nodes = [e[4] for e in events if e[:2] == ("construct", "prefill")]
        assert len(stores) == 2 and sorted(prefill_nodes) == sorted(stores)
        head = ray.get_runtime_context().get_node_id()
        gateway_node = next(e[3] for e in events if e[:2] == ("start", "gateway"))
        assert gateway_node == head
        assert len(status["stores"]) == 2


def test_labels_resources_and_gpu_fractions_put_each_pool_on_its_node_type(registry):
    # prefill fits either node by CPUs: only its label keeps it off the gpu node; the two decode
    # replicas need the custom resource and half a GPU each, which only the gpu node has.
    config = small_config(
        prefill={"num_cpus": 0.25, "node_labels": {"node-type": "!gpu"}},
        decode={"replicas": 2, "num_cpus": 0.25, "num_gpus": 0.5, "resources": {"decode_slot": 1}},
    )
    with run_cluster(config, actor_classes=FAKE_CLASSES) as cluster:
        status = cluster.status()
        assert status["healthy"]
        assert status["pools"]["decode"]["bundle"] == {"CPU": 0.25, "GPU": 0.5, "decode_slot": 1.0}
        events = ray.get(registry.get_events.remote())
        stores = _check_each_worker_got_its_nodes_store(events)
        head = ray.get_runtime_context().get_node_id()
        (gpu_node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
        assert [e[4] for e in events if e[:2] == ("construct", "prefill")] == [head]
        assert [e[4] for e in events if e[:2] == ("construct", "decode")] == [gpu_node, gpu_node]
        assert sorted(stores) == sorted([head, gpu_node])


def test_labels_no_node_carries_fail_at_once_naming_them(registry):
    config = small_config(decode={"node_labels": {"node-type": "tpu"}})
    with pytest.raises(
        ClusterError, match=r"pool 'decode'.*no node carries the labels \{'node-type': 'tpu'\}"
    ):
        run_cluster(config, actor_classes=FAKE_CLASSES)
    assert is_dead_controller()


def test_gateways_on_every_node_each_node_its_own_port_with_one_ledger(registry):
    config = small_config(gateway={"replicas": 2, "placement": "every_node"}, decode={"num_cpus": 0.25})
    with run_cluster(config, actor_classes=FAKE_CLASSES) as cluster:
        status = cluster.status()
        assert status["healthy"] and status["ledger"]["healthy"]
        events = ray.get(registry.get_events.remote())
        started = [(e[2], e[3]) for e in events if e[:2] == ("start", "gateway")]  # (address, node)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert sorted(node for _, node in started) == sorted(nodes * 2)  # two on each node
        ports = {node: {address for address, on in started if on == node} for node in nodes}
        assert all(len(shared) == 1 for shared in ports.values()), ports  # the two on a node share its port
        assert len({address for address, _ in started}) == len(nodes)  # each node's its own
        assert [g["node_id"] for g in status["gateways"]] == [n for n in sorted(nodes) for _ in range(2)]
