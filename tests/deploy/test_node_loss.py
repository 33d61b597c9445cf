"""A node lost for good (its raylet and everything on it killed), with fake actors: the workers
it held come back where Ray re-places their bundles, each given the store of the node it now
runs on, the lost node's store leaves the roster, and the gateway hears the new addresses. The
decode pool is kept to the nodes with a `decode_host` resource: the second node, then a spare
added before the loss (the head has none)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from deploy import placement
from deploy import starter as starter_module
from deploy.launcher import run_cluster
from deploy.members import Member, Pool, Roster
from deploy.placement import HEAD_NODE_RESOURCE, NodeIps
from deploy.starter import ActorStarter
from tests.deploy.conftest import two_node_cluster
from tests.deploy.fakes import FAKE_CLASSES, REGISTRY_NAME, REGISTRY_NAMESPACE, Registry
from tests.deploy.helpers import small_config, wait_until

DECODE_HOST = {"decode_host": 1.0}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    with two_node_cluster(resources=DECODE_HOST) as cluster:
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
            nodes = {store["node_id"] for store in status["stores"]}  # the lost store goes on a later pass
            settled = lost.node_id not in nodes and spare.node_id in nodes
            return status if row["healthy"] and row["node_id"] == spare.node_id and settled else None

        status = wait_until(
            moved,
            timeout_s=120,
            what="the decode worker healthy on the spare node, and the stores moved with it",
        )
        assert _decode(status)["restarts"] >= 1
        stores = {row["node_id"]: row["address"] for row in status["stores"]}
        assert lost.node_id not in stores and spare.node_id in stores, status["stores"]
        events = ray.get(registry.get_events.remote())
        last_construct = [e for e in events if e[:2] == ("construct", "decode")][-1]
        assert last_construct[2] == stores[spare.node_id] and last_construct[4] == spare.node_id
        told = [e for e in events if e[0] == "update_workers"][-1]
        assert told[2] == [_decode(status)["address"]]


def test_a_worker_that_lands_off_the_node_whose_store_it_was_given_is_started_again_beside_the_right_one(
    ray_cluster, registry, monkeypatch
):
    """As when a node is lost after its bundle's place was read but before Ray marked it dead: the
    worker was given that node's store, and Ray created it where the bundle went. Here the first
    reading of the bundle's place names the other node (the bundle is on the head)."""
    nodes = ray_cluster.list_all_nodes()  # the head first
    head, other = nodes[0].node_id, nodes[1].node_id
    group = placement_group([{"CPU": 0.5, HEAD_NODE_RESOURCE: 0.001}])
    ray.get(group.ready(), timeout=60)
    readings = iter([other])

    async def placed_node(member: Member, wait_s: float) -> str:
        return next(readings, None) or await placement.placed_node(member, wait_s)

    monkeypatch.setattr(starter_module, "placed_node", placed_node)
    config = small_config()
    roster = Roster()
    starter = ActorStarter(config, roster, NodeIps(), FAKE_CLASSES, cluster_token="t")
    asyncio.run(starter.prepare())
    spec = starter.spec(config, "decode")
    roster.pools["decode"] = Pool(name="decode", role="decode", spec=spec, replicas=1)
    worker = Member(kind="decode", index=0, pool="decode", group=group, bundle_index=0, spec=spec)
    try:
        asyncio.run(starter.start_worker(worker))
        constructed = [e for e in ray.get(registry.get_events.remote()) if e[:2] == ("construct", "decode")]
        assert [(e[2], e[4]) for e in constructed] == [
            (roster.stores[other].address, head),  # given the other node's store: not started
            (roster.stores[head].address, head),
        ]
        assert worker.node_id == head and worker.healthy
        assert [e for e in ray.get(registry.get_events.remote()) if e[:2] == ("start", "decode")] == [
            ("start", "decode", worker.address, head)
        ]
    finally:
        for member in [worker, *roster.stores.values()]:
            starter.kill(member)
        remove_placement_group(group)
