"""Helpers shared by the deploy tests: a small config, polling, liveness checks, the status shape."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import ray

from deploy.controller import CONTROLLER_NAME, NAMESPACE
from splitserve.config import ClusterConfig, parse_config

T = TypeVar("T")


def small_config(**overrides: Any) -> ClusterConfig:
    """Everything on 2 logical CPUs, with a fast health loop."""
    data: dict[str, Any] = {
        "model": {"path": "/models/not-loaded-by-fakes", "name": "fake-model"},
        "gateway": {"port": 0},
        "prefill": {"num_cpus": 0.5},
        "decode": {"num_cpus": 0.5},
        "health": {"interval_s": 0.2, "timeout_s": 10, "max_restarts": 2, "start_timeout_s": 30},
    }
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    return parse_config(data)


def is_dead(handle: Any) -> bool:
    try:
        ray.get(handle.health.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


def is_dead_controller() -> bool:
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        return True
    return False


def wait_until(probe: Callable[[], T | None], *, timeout_s: float = 60, what: str = "condition") -> T:
    """Poll `probe` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


# The documented shape of `status()` (deploy/README.md, "Status as JSON").
STATUS_KEYS = {"mode", "model", "started", "stopped", "healthy", "gateway", "pools", "stores", "published"}
STATUS_KEYS |= {"apply", "autoscale", "gateways", "ledger"}
POOL_KEYS = {"role", "replicas", "placement", "bundle", "addresses", "num_healthy", "healthy", "restarts"}
POOL_KEYS |= {"load", "workers", "desired_replicas", "num_outdated", "node_labels", "tensor_parallel"}
APPLY_KEYS = {"in_progress", "plan", "done", "step", "error"}
ROW_KEYS = {"kind", "pool", "index", "address", "node_id", "node_ip", "pid", "healthy", "restarts"}
ROW_KEYS |= {"given_up", "error", "stats"}


def check_status_shape(status: dict[str, Any]) -> None:
    """Assert that `status` is plain JSON with the documented keys, every actor placed and running."""
    assert json.loads(json.dumps(status)) == status
    assert set(status) == STATUS_KEYS
    assert status["gateway"] == status["gateways"][0]
    rows = [*status["gateways"], *status["stores"], *([status["ledger"]] if status["ledger"] else [])]
    assert set(status["apply"]) == APPLY_KEYS
    for name, pool in status["pools"].items():
        assert set(pool) == POOL_KEYS
        assert [w["index"] for w in pool["workers"]] == list(range(pool["replicas"]))
        for worker in pool["workers"]:
            assert worker["pool"] == name and worker["kind"] == pool["role"]
            assert worker["outdated"] is False  # no apply has run
        rows += pool["workers"]
    assert all(set(gateway) == ROW_KEYS | {"url"} for gateway in status["gateways"])
    for row in rows:
        assert set(row) >= ROW_KEYS, row
        assert isinstance(row["pid"], int) and row["pid"] > 0, row
        assert isinstance(row["node_id"], str) and len(row["node_id"]) == 56, row  # Ray's hex node ids
    assert all(store["kind"] == "store" and store["pool"] is None for store in status["stores"])
