"""The gateway's load report for the autoscaler and the autoscaler's series on its /metrics,
through a gateway (a plain `GatewayActor`) serving real requests to fake workers."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from frontend.actor import GatewayActor
from frontend.settings import GatewaySettings
from splitserve.v1 import decode_pb2
from tests.frontend.conftest import MODEL
from tests.frontend.fakes import FakeDecode, FakePrefill, FakeWorkerServer


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


def _count(buckets: list[tuple[float | str, float]]) -> float:
    """Observations in all (the +Inf bucket's count; none before the first)."""
    if not buckets:
        return 0.0
    assert buckets[-1][0] == "+Inf"
    return buckets[-1][1]


def test_the_load_report_carries_the_queue_the_workers_load_and_latency_buckets(tiny_model_path, script):
    decode = FakeDecode(
        script,
        stats=decode_pb2.DecodeStats(
            max_num_seqs=8,
            num_free_kv_blocks=30,
            num_total_kv_blocks=100,
            num_free_state_slots=5,
            num_total_state_slots=8,
        ),
    )
    servers = [FakeWorkerServer(FakePrefill(script)), FakeWorkerServer(decode)]
    settings = GatewaySettings(
        model_name=MODEL,
        model_path=str(tiny_model_path),
        max_model_len=256,
        stats_refresh_s=0.05,
        enable_prefix_caching=False,
    )
    gateway = GatewayActor(settings, [servers[0].address], [servers[1].address])
    try:
        address = gateway.start("127.0.0.1", 0)
        before = gateway.load_report()
        with httpx.Client(base_url=f"http://{address}", timeout=30) as http:
            for _ in range(3):
                response = http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}
                )
                assert response.status_code == 200, response.text
        _wait_for(lambda: servers[1].address in gateway.load_report()["decode"], "the decode worker's Stats")
        report = gateway.load_report()
    finally:
        gateway.shutdown(0)
        for server in servers:
            server.stop()
    assert report["decode"] == {
        servers[1].address: {
            "num_free_kv_blocks": 30,
            "num_total_kv_blocks": 100,
            "num_free_state_slots": 5,
            "num_total_state_slots": 8,
        }
    }
    assert report["prefill"] == {servers[0].address: {"num_outstanding_prompt_tokens": 0}}
    assert (report["num_queued"], report["num_slots_in_use"]) == (0, 0)
    assert report["num_slots_capacity"] == 5 + 3  # the ledger counts the worker's slots, not its free ones
    histograms = report["histograms"]
    assert _count(histograms["ttft_s"]) - _count(before["histograms"]["ttft_s"]) == 3
    assert _count(histograms["itl_s"]) > _count(before["histograms"]["itl_s"])
    assert _count(histograms["queue_wait_s"]) == 3


def test_the_autoscalers_decisions_and_replicas_show_on_the_gateways_metrics(tiny_model_path):
    settings = GatewaySettings(model_name=MODEL, model_path=str(tiny_model_path), max_model_len=256)
    gateway = GatewayActor(settings)
    gateway.publish_autoscale(
        {
            "decisions": [["decode", "up", "queue", 2], ["decode", "down", "idle", 1]],
            "desired": {"decode": 2},
            "actual": {"decode": 1},
        }
    )
    text = gateway.app.state.pipeline.metrics.render().decode()
    assert 'splitserve_autoscale_decisions_total{direction="up",pool="decode",reason="queue"} 2.0' in text
    assert 'splitserve_autoscale_decisions_total{direction="down",pool="decode",reason="idle"} 1.0' in text
    assert 'splitserve_autoscale_desired_replicas{pool="decode"} 2.0' in text
    assert 'splitserve_autoscale_replicas{pool="decode"} 1.0' in text
