"""A real cluster whose prefill pool is empty (its one worker killed, no restarts): with
`prefill.fallback: decode_local` the decode worker computes the prompt itself and the tokens equal
a normal run's; with `fail` the request gets a 503 naming the empty pool. Both are counted.

The same cluster checks the locks on its internal doors: a gRPC call without the deployment's
token is refused, one with it works, and the token is in none of Ray's log files."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import ray

from deploy.launcher import ClusterHandle, run_cluster
from splitserve import rpc
from splitserve.config import parse_config
from splitserve.tiny_model import make_tiny_model
from splitserve.v1 import decode_pb2, decode_pb2_grpc
from tests.deploy.helpers import wait_until
from tests.e2e.helpers import MODEL, store_contents, worker_stats

PROMPT = [5 + i % 300 for i in range(40)]
DECODE_SLOTS = 4  # the decode pool's room, small so that a burst overflows it
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["decode_local", "fail"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tiny_model(tmp_path_factory.mktemp("fallback-model"), seed=7)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    config = parse_config(
        {
            "model": {"path": str(model), "name": MODEL},
            "gateway": {"port": 0},
            "prefill": {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "fallback": request.param},
            "decode": {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": DECODE_SLOTS},
            "store": {"memory_bytes": "64MiB", "disk": {"path": None}},
            # no restarts: a killed prefill worker stays gone, so the pool is empty
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300, "max_restarts": 0},
        }
    )
    try:
        with run_cluster(config) as handle:
            yield handle
    finally:
        ray.shutdown()


def _token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _complete(url: str) -> httpx.Response:
    body = {**BODY, "logprobs": 0, "return_tokens_as_token_ids": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)  # a guard against a hang


def _complete_samples(url: str) -> list[list[int]]:
    """A seeded request of 3 samples; each choice's token ids, by index."""
    body = {**BODY, "n": 3, "seed": 5, "temperature": 0.9, "logprobs": 0, "return_tokens_as_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in choices]


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = ",".join(f'{k}="{v}"' for k, v in {"model_name": MODEL, **labels}.items())
    match = re.search(rf"^{name}\{{{wanted}\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _empty_the_prefill_pool(cluster: ClusterHandle) -> None:
    ray.kill(ray.get(cluster.controller.worker_handle.remote("prefill", 0), timeout=30))
    url = cluster.gateway_url
    wait_until(
        lambda: (
            _metric(url, "splitserve_num_workers", role="prefill") == 0
            and _metric(url, "splitserve_num_workers", role="decode") == 1
        ),
        what="the gateway to hear that the prefill pool is empty",
        timeout_s=120,
    )


def test_a_burst_past_the_decode_pool_waits_its_turn_and_an_impossible_request_gets_400(
    cluster: ClusterHandle,
) -> None:
    """Four times the pool's slots at once: every request completes (queued, not 429); a request
    with more prompts than the pool holds is a 400 and leaves every slot free."""
    url = cluster.gateway_url
    assert url is not None
    wait_until(
        lambda: _metric(url, "splitserve_admission_slots_capacity") == DECODE_SLOTS,
        what="the gateway to read the decode pool's capacity",
    )
    with ThreadPoolExecutor(4 * DECODE_SLOTS) as pool:
        responses = list(pool.map(lambda _: _complete(url), range(4 * DECODE_SLOTS)))
    assert [r.status_code for r in responses] == [200] * (4 * DECODE_SLOTS)
    assert len({tuple(_token_ids(r)) for r in responses}) == 1  # greedy: queued or not, same tokens
    too_many = httpx.post(
        f"{url}/v1/completions", json={**BODY, "prompt": [PROMPT] * (DECODE_SLOTS + 1)}, timeout=120
    )
    assert too_many.status_code == 400 and f"holds {DECODE_SLOTS}" in too_many.json()["error"]["message"]
    # each sample decodes in a slot of its own: more samples than the pool holds never fit either
    too_many = httpx.post(f"{url}/v1/completions", json={**BODY, "n": DECODE_SLOTS + 1}, timeout=120)
    assert too_many.status_code == 400 and f"holds {DECODE_SLOTS}" in too_many.json()["error"]["message"]
    stats = worker_stats(cluster, "decode", 0)
    assert stats["num_free_state_slots"] == stats["num_total_state_slots"] and stats["num_reserved"] == 0
    assert _metric(url, "splitserve_admission_refusals_total", reason="never_fits") == 2


@pytest.fixture
def policy(request: pytest.FixtureRequest) -> str:
    """The running cluster's `prefill.fallback`."""
    return str(request.node.callspec.params["cluster"])


def test_an_empty_prefill_pool_follows_prefill_fallback(cluster: ClusterHandle, policy: str) -> None:
    url = cluster.gateway_url
    assert url is not None
    expected = _token_ids(_complete(url))  # through the prefill worker, as usual
    expected_samples = _complete_samples(url)
    _empty_the_prefill_pool(cluster)
    response = _complete(url)
    if policy == "decode_local":
        assert _token_ids(response) == expected  # the decode worker's own prefill: same tokens
        streamed = httpx.post(f"{url}/v1/completions", json={**BODY, "stream": True}, timeout=120)
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in streamed.text
        # n samples: the decode worker draws every first token from its own prefill, same tokens
        assert _complete_samples(url) == expected_samples
        assert _metric(url, "splitserve_prefill_fallbacks_total", policy="decode_local") == 3
    else:
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert "prefill pool has no worker" in message and "prefill.fallback is fail" in message
        assert _metric(url, "splitserve_prefill_fallbacks_total", policy="fail") == 1
    stats = worker_stats(cluster, "decode", 0)
    assert (stats["num_running"], stats["num_waiting"], stats["num_reserved"]) == (0, 0, 0)
    assert stats["num_free_state_slots"] == stats["num_total_state_slots"]


def test_internal_grpc_refuses_callers_without_the_deployments_token(
    cluster: ClusterHandle, policy: str
) -> None:
    if policy != "decode_local":
        pytest.skip("checked once, on the first cluster")
    decode_address = cluster.status()["pools"]["decode"]["workers"][0]["address"]
    assert not decode_address.startswith("0.0.0.0")
    with grpc.insecure_channel(decode_address) as bare, pytest.raises(grpc.RpcError) as refused:
        decode_pb2_grpc.DecodeStub(bare).Stats(decode_pb2.DecodeStatsRequest(), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with rpc.make_channel(decode_address) as channel:  # this driver started the deployment: it holds it
        stats = decode_pb2_grpc.DecodeStub(channel).Stats(decode_pb2.DecodeStatsRequest(), timeout=30)
    assert stats.num_total_state_slots > 0
    for store in cluster.status()["stores"]:
        assert store_contents(store["address"]) == (0, 0)
    token = cluster.cluster_token
    assert token and token == ray.get(cluster.controller.cluster_token.remote(), timeout=30)
    logs = Path(ray._private.worker._global_node.get_session_dir_path())
    leaked = [
        str(path)
        for path in logs.rglob("*")
        if path.is_file() and not path.is_symlink() and token.encode() in _read(path)
    ]
    assert not leaked, f"the cluster token is written in {leaked}"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a socket or a file removed while we walk
        return b""
