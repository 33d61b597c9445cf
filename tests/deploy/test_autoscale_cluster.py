"""The autoscaler on a real deployment (local Ray: controller, gateway, workers and store as
processes, the tiny model): a closed-loop load of greedy streams larger than one decode
replica's slots makes requests wait for decode room, and the planner adds a decode replica (the
pool's `autoscale` allows 1..2); when the load falls to one client, the planner drains the
replica again while that client streams. No request fails, no stream needed the gateway's
failover (the drain, not the safety net, kept them whole), and every decision shows in
`status()` and on every gateway process's /metrics. Run with one gateway process and with two
sharing the port (the planner adds up both processes' load reports)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import ray

from deploy.launcher import ClusterHandle, run_cluster
from splitserve.config import parse_config
from splitserve.tiny_model import make_tiny_model
from tests.faults.conftest import metric_value
from tests.faults.load import ClosedLoopLoad, num_ok_since, random_prompts, summary

MODEL = "tiny"
NUM_TOKENS = 24
PROMPTS = random_prompts(seed=5, count=16, min_len=8, max_len=48)
SLOTS_PER_DECODE = 2  # six clients overflow one replica, and two
AUTOSCALE = {
    "min_replicas": 1,
    "max_replicas": 2,
    "interval_s": 0.5,
    "scale_up_after_s": 1,
    "scale_down_after_s": 2,
    "cooldown_s": 1,
    "target_occupancy": 1.0,
    "scale_down_below": 0.6,  # one client on 2 x 2 slots: 0.25, 0.5 with one replica fewer: idle
}
DECISIONS = "splitserve_autoscale_decisions_total"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("autoscale-model"), seed=3)


@pytest.fixture(params=[1, 2], ids=["one-gateway", "two-gateways"])
def cluster(request: pytest.FixtureRequest, model_path: Path) -> Iterator[ClusterHandle]:
    pool = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB"}
    config = parse_config(
        {
            "model": {"path": str(model_path), "name": MODEL},
            "gateway": {"port": 0, "replicas": request.param},
            "prefill": pool,
            "decode": {
                **pool,
                "max_num_seqs": SLOTS_PER_DECODE,
                "autoscale": AUTOSCALE,
                "slo": {"itl_ms": 2000},
            },
            "store": {"memory_bytes": "256MiB", "disk": {"path": None}},
            "cache": {"enable_prefix_caching": False},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300, "drain_timeout_s": 120},
        }
    )
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        with run_cluster(config) as handle:
            yield handle
    finally:
        ray.shutdown()


def _body(client: int, n: int) -> dict[str, Any]:
    prompt = PROMPTS[(client * 3 + n) % len(PROMPTS)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}


def _poll(condition: Callable[[], bool], what: str, timeout_s: float = 240.0) -> None:
    """Until `condition()` holds; `timeout_s` guards against a hang, it bounds no latency."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, f"never saw {what}"
        time.sleep(0.25)


def _own_urls(cluster: ClusterHandle) -> list[str]:
    """Each gateway process's own URL (its /metrics there, not whichever process the port picks)."""
    return [f"http://{row['stats']['own_address']}" for row in cluster.status()["gateways"]]


def _decisions(url: str, direction: str, count: int) -> bool:
    return metric_value(url, DECISIONS, pool="decode", direction=direction) == count


def _failovers(urls: list[str]) -> float:
    return sum(metric_value(url, "splitserve_decode_failovers_total") for url in urls)


def _decode(cluster: ClusterHandle) -> tuple[int, int]:
    """(replicas running, replicas desired) of the decode pool."""
    pool = cluster.status()["pools"]["decode"]
    return pool["replicas"], pool["desired_replicas"]


def test_a_real_load_scales_the_decode_pool_up_and_its_fall_drains_it_failing_no_request(cluster):
    url = cluster.gateway_url or ""
    _poll(
        lambda: all(r["stats"].get("own_address") for r in cluster.status()["gateways"]),
        "every gateway's port",
    )
    own = _own_urls(cluster)
    failovers = _failovers(own)
    assert _decode(cluster) == (1, 1)
    heavy = ClosedLoopLoad(url, _body, num_clients=3 * SLOTS_PER_DECODE)
    light: ClosedLoopLoad | None = None
    try:
        _poll(lambda: _decode(cluster) == (2, 2), "the decode pool scaled up to 2")
        count = len(heavy.outcomes)
        heavy.wait_for(lambda out: len(out) >= count + 6, "requests served by two decode replicas")
        light = ClosedLoopLoad(url, _body, num_clients=1)
        heavy_outcomes = heavy.stop()
        fell_s = time.monotonic()
        _poll(lambda: _decode(cluster) == (1, 1), "the decode pool drained back to 1")
        count = len(light.outcomes)
        light.wait_for(lambda out: len(out) >= count + 2, "requests after the scale-down")
    finally:
        light_outcomes = light.stop() if light is not None else []
        heavy.stop()

    outcomes = heavy_outcomes + light_outcomes
    assert outcomes and all(o.ok for o in outcomes), summary(outcomes)
    assert num_ok_since(light_outcomes, fell_s) >= 2
    assert _failovers(own) == failovers, "a stream was cut"
    for process in own:  # every gateway process shows the planner's series
        _poll(partial(_decisions, process, "down", 1), "the down on every gateway process")
        assert metric_value(process, DECISIONS, pool="decode", direction="down", reason="idle") == 1
        # one up (at max the load that stayed was held, not counted again), one down
        assert metric_value(process, DECISIONS, pool="decode", direction="up") == 1
        assert metric_value(process, "splitserve_autoscale_desired_replicas", pool="decode") == 1
    status = cluster.status()
    scaled = status["autoscale"]["decode"]
    assert (scaled["min_replicas"], scaled["max_replicas"], scaled["replicas"]) == (1, 2, 1)
    assert scaled["error"] is None and status["healthy"]
    assert status["apply"]["plan"][0].startswith("autoscale: decode 2 -> 1 (idle: ")
    assert "prefill" not in status["autoscale"]  # a pool without autoscale is left alone
