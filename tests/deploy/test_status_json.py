"""`status()` as a program reads it (`splitserve status --json`): the documented shape, each actor's
pool, replica index, node and process, with fake actors (the real ones' counts are checked in
test_controller.py)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import ray

from deploy.launcher import run_cluster
from deploy.report import status_table
from tests.deploy.fakes import FAKE_CLASSES
from tests.deploy.helpers import check_status_shape, small_config

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _pid(_self: Any) -> int:
    return os.getpid()


def test_status_names_each_actors_pool_replica_node_and_pid_as_plain_json(registry):
    with run_cluster(small_config(prefill={"replicas": 2}), actor_classes=FAKE_CLASSES) as cluster:
        status = cluster.status()
        handles = ray.get(registry.get_handles.remote())
        pids = {address: ray.get(h.__ray_call__.remote(_pid)) for _, address, h in handles}
    check_status_shape(status)
    node_id = ray.get_runtime_context().get_node_id()  # one node: everything is on it
    node_ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    prefill = status["pools"]["prefill"]["workers"]
    assert [(w["pool"], w["index"]) for w in prefill] == [("prefill", 0), ("prefill", 1)]
    rows = [status["gateway"], *status["stores"], *prefill, *status["pools"]["decode"]["workers"]]
    assert len(rows) == len(pids) == 5
    for row in rows:
        assert row["node_id"] == node_id and row["node_ip"] == node_ip
        assert row["pid"] == pids[row["address"]] != os.getpid()
        assert row["healthy"] and row["restarts"] == 0 and row["error"] is None
    assert status["pools"]["decode"]["workers"][0]["stats"] == {"num_running": 1, "kind": "decode"}
    assert status["gateway"]["url"] == f"http://{status['gateway']['address']}"
    assert status_table(json.loads(json.dumps(status)))  # what --json prints still makes the table
