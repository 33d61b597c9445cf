"""A prefill worker killed mid-request, where no other prefill worker is left and
`prefill.fallback: fail` forbids the decode worker to compute prompts, ends that request with a
clear error, never a hang. (With the default `decode_local` the request is served anyway:
tests/faults/test_prefill_kill.py.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray

from deploy.launcher import run_cluster
from splitserve.config import parse_config
from splitserve.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("kill-model"), seed=5)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    # a tiny token budget makes a long prompt's prefill take many steps, so it can be killed midway
    slow_prefill = {
        "num_cpus": 0.5,
        "kv_cache_memory_bytes": "32MiB",
        "max_num_batched_tokens": 8,
        "fallback": "fail",
    }
    config = parse_config(
        {
            "model": {"path": str(model), "name": "tiny"},
            "gateway": {"port": 0},
            "prefill": slow_prefill,
            "decode": {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB"},
            "store": {"memory_bytes": "64MiB", "disk": {"path": None}},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300},
        }
    )
    try:
        with run_cluster(config) as handle:
            yield handle
    finally:
        ray.shutdown()


def test_killing_the_prefill_worker_fails_its_request_with_a_clear_error(cluster):
    base = cluster.gateway_url
    prompt = [3 + i % 2000 for i in range(3000)]
    outcome: dict[str, httpx.Response] = {}
    finished = threading.Event()

    def send() -> None:
        outcome["response"] = httpx.post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
            timeout=120,  # a guard against a hang, not a latency assertion
        )
        finished.set()

    threading.Thread(target=send, daemon=True).start()
    prefill = ray.get(cluster.controller.worker_handle.remote("prefill", 0))
    deadline = time.monotonic() + 60
    while ray.get(prefill.stats.remote())["num_running"] == 0:  # wait until the prompt is being prefilled
        assert time.monotonic() < deadline and not finished.is_set(), f"the prefill never started: {outcome}"
        time.sleep(0.01)
    ray.kill(prefill)
    assert finished.wait(120), "the request hung after its prefill worker died"
    response = outcome["response"]
    assert response.status_code == 503
    error = response.json()["error"]
    assert "prefill" in error["message"].lower() and "fallback is fail" in error["message"], error
