"""Helpers shared by the deploy tests: a small config, polling, liveness checks."""

from __future__ import annotations

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
