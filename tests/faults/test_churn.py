"""Worker churn: both pools resized up and down several times, with traffic in between, leave
every registry the deployment keeps bounded by what is running now: the controller's pools and
placement groups, the workers the gateway routes to and reports, the stores and their leases,
and the per-store series in the gateway's metrics. Real deployment on local Ray."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from deploy.launcher import ClusterHandle
from tests.e2e.helpers import assert_idle
from tests.faults.conftest import MODEL, fault_cluster, metric_value, wait_for

NUM_CYCLES = 3
WAIT_S = 120.0  # a guard against a hang, not a latency bound


@pytest.fixture(scope="module")
def cluster(fault_model: Path) -> Iterator[ClusterHandle]:
    pool = {"kv_cache_memory_bytes": "32MiB", "num_cpus": 0.25}
    with (
        tempfile.TemporaryDirectory(prefix="splitserve-faults-") as tmp,
        fault_cluster(Path(tmp) / "faults.json", fault_model, prefill=pool, decode=pool) as handle,
    ):
        yield handle


def _traffic(url: str, seed: int, num_requests: int = 8) -> None:
    rng = random.Random(seed)

    def one(i: int) -> int:
        prompt = [rng.randrange(3, 2000) for _ in range(rng.randint(4, 80))]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": i % 2 == 1}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_S).status_code

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(one, range(num_requests)))
    assert codes == [200] * num_requests, codes


def _num_placement_groups() -> int:
    return sum(1 for group in ray.util.placement_group_table().values() if group["state"] == "CREATED")


def _store_series(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        sample.labels["store"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "store" in sample.labels
    }


def _assert_bounded(cluster: ClusterHandle, num_prefill: int, num_decode: int) -> None:
    url = cluster.gateway_url or ""
    status = cluster.status()
    pools = status["pools"]
    assert [len(pools[p]["workers"]) for p in ("prefill", "decode")] == [num_prefill, num_decode], pools
    assert len(status["stores"]) == 1  # one node, one store, however often its workers changed
    assert _num_placement_groups() <= num_prefill + num_decode
    published = status["published"]
    assert published is not None
    assert sorted(published["prefill"]) == sorted(pools["prefill"]["addresses"])
    assert sorted(published["decode"]) == sorted(pools["decode"]["addresses"])

    def gateway_knows_exactly_these() -> bool:
        gateway = cluster.status()["gateway"]["stats"]
        prefill = metric_value(url, "splitserve_num_workers", role="prefill")
        decode = metric_value(url, "splitserve_num_workers", role="decode")
        counts = (gateway.get("prefill_workers"), gateway.get("decode_workers"), prefill, decode)
        return counts == (num_prefill, num_decode, num_prefill, num_decode)

    wait_for(gateway_knows_exactly_these, f"the gateway routing to {num_prefill}+{num_decode} workers")
    assert len(_store_series(url)) <= len(status["stores"])
    assert_idle(cluster, timeout_s=60)  # every lease released, every block and slot free


def test_resizing_up_and_down_leaves_every_registry_bounded(cluster: ClusterHandle) -> None:
    url = cluster.gateway_url or ""
    _traffic(url, seed=0)
    _assert_bounded(cluster, 1, 1)
    for cycle in range(NUM_CYCLES):
        cluster.resize("prefill", 2)
        cluster.resize("decode", 2)
        _assert_bounded(cluster, 2, 2)
        _traffic(url, seed=2 * cycle + 1)
        cluster.resize("prefill", 1)
        cluster.resize("decode", 1)
        _traffic(url, seed=2 * cycle + 2)
        _assert_bounded(cluster, 1, 1)
