"""A real deployment (1 prefill + 1 decode worker, prefix caching on, as by default) heals by itself
after a real SIGKILL of one of its processes under a bounded load: every request that starts once
the controller has restarted the process succeeds, and once the load stops nothing is held.

The kills are SIGKILLs of the processes the controller's status names; what is checked is read at
its source (the workers' own stats, the stores' Stats RPC: tests/e2e/helpers.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from deploy.launcher import ClusterHandle, run_cluster
from splitserve.config import parse_config
from tests.e2e.helpers import assert_idle
from tests.faults.conftest import MODEL, wait_for
from tests.faults.load import ClosedLoopLoad, Outcome, num_ok_since, random_prompts, summary

NUM_CLIENTS = 8
NUM_AFTER_HEALED = 24  # requests that must start and succeed once the deployment has healed
PROMPTS = random_prompts(seed=5, count=32, min_len=16, max_len=96)


@pytest.fixture(scope="module")
def cluster(fault_model: Path) -> Iterator[ClusterHandle]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    pool = {"num_cpus": 0.5, "kv_cache_memory_bytes": "64MiB", "max_num_seqs": 16}
    config = parse_config(
        {
            "model": {"path": str(fault_model), "name": MODEL},
            "gateway": {"port": 0},
            "prefill": pool,
            "decode": pool,
            "store": {"memory_bytes": "256MiB", "disk": {"path": None}},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300, "max_restarts": 10},
        }
    )
    try:
        with run_cluster(config) as handle:
            yield handle
    finally:
        ray.shutdown()


def _body(client: int, n: int) -> dict[str, Any]:
    prompt = PROMPTS[(client * 7 + n) % len(PROMPTS)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _store_row(cluster: ClusterHandle) -> dict[str, Any]:
    (row,) = cluster.status()["stores"]
    return row  # type: ignore[no-any-return]


def _restarted(cluster: ClusterHandle, before: dict[str, Any]) -> bool:
    row = _store_row(cluster)
    return bool(row["healthy"] and row["restarts"] > before["restarts"] and row["pid"] != before["pid"])


def _heals_after(load: ClosedLoopLoad, restarted_s: float) -> list[Outcome]:
    """Waits for the first success that started after `restarted_s`, then for NUM_AFTER_HEALED
    more requests to start and end; the outcomes of every request started since that success."""
    load.wait_for(lambda out: num_ok_since(out, restarted_s) > 0, "a request succeed after the restart")
    healed_s = min(o.started_s for o in load.outcomes if o.started_s >= restarted_s and o.ok)
    load.wait_for(
        lambda out: sum(1 for o in out if o.started_s >= healed_s) >= NUM_AFTER_HEALED,
        f"{NUM_AFTER_HEALED} requests after the deployment healed",
    )
    return [o for o in load.stop() if o.started_s >= healed_s]


def test_a_store_killed_under_load_heals_and_holds_nothing(cluster: ClusterHandle) -> None:
    """Before the fix, every reservation whose state reader could not reach the dead store kept
    its decode slot: once the store was back every request got 429 "every decode worker is full"
    for good, and the decode worker showed no free slot with nothing running."""
    load = ClosedLoopLoad(cluster.gateway_url or "", _body, NUM_CLIENTS)
    try:
        load.wait_for(lambda out: num_ok_since(out, 0) >= NUM_CLIENTS, "the load running")
        before = _store_row(cluster)
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda: _restarted(cluster, before), "the store restarted")
        after_healed = _heals_after(load, time.monotonic())
    finally:
        outcomes = load.stop()
    failed = [o for o in after_healed if not o.ok]
    assert not failed, f"requests failed after the deployment healed: {summary(failed)}; all: {summary(outcomes)}"
    assert_idle(cluster, timeout_s=60)
