"""Real workers on two Ray nodes (two raylets on this machine): prefill on one node, decode on
the other, each beside its own node's store, so the prefilled state crosses nodes. Through the
real gateway and the official openai client, the tokens equal the offline engine's, and the
state took one hop: the prefill wrote into its own node's store and the decode read it from
there (its own node's store served no read). Afterwards every worker is idle and both stores are
empty. Killing the prefill node's store while a request's state is on its way fails that request
closed (503), no hang, and the deployment serves again once the store is back."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster

from deploy.launcher import ClusterHandle, run_cluster
from splitserve import LLM, SamplingParams
from splitserve.config import parse_config
from splitserve.state.client import StateStoreClient
from splitserve.tiny_model import make_tiny_model
from state_store.faults import ENV_VAR
from tests.deploy.conftest import two_node_cluster
from tests.e2e.helpers import assert_idle, complete, openai_client
from tests.faults.conftest import FaultFile, wait_for

NUM_CPUS_PER_NODE = 2
# Every node has 2 CPUs and each worker reserves 1.5: whichever node the first worker takes, the
# other fits only on the other node. The head also holds its store (0.25) and the gateway (0.25).
WORKER = {"num_cpus": 1.5, "kv_cache_memory_bytes": "16MiB", "max_num_seqs": 8}
PROMPTS = [[3, 17, 99, 5], list(range(40, 140)), [7] * 33, [1999, 4, 250]]
PARAMS: list[dict[str, Any]] = [
    {"max_tokens": 6, "temperature": 0.0},
    {"max_tokens": 5, "temperature": 0.0},
    {"max_tokens": 6, "temperature": 0.9, "top_p": 0.95, "seed": 21},
    {"max_tokens": 1, "temperature": 0.0},  # prefill only: no state crosses
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("multinode-model"), seed=9)


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> FaultFile:
    """The stores' fault hook (state_store/faults.py): disarmed until a test arms it."""
    path = tmp_path_factory.mktemp("multinode-faults") / "faults.json"
    path.write_text(json.dumps({}))
    return FaultFile(path)


@pytest.fixture(scope="module")
def two_nodes(faults: FaultFile) -> Iterator[Cluster]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV_VAR, str(faults.path))  # before the raylets start: every store inherits it
        with two_node_cluster(NUM_CPUS_PER_NODE) as cluster:
            yield cluster


@pytest.fixture(scope="module")
def served(two_nodes: Cluster, model_path: Path) -> Iterator[ClusterHandle]:
    config = parse_config(
        {
            "model": {"path": str(model_path), "name": "tiny"},
            "gateway": {"port": 0},
            "prefill": WORKER,
            "decode": WORKER,
            "store": {"memory_bytes": "64MiB", "disk": {"path": None}},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300},
        }
    )
    with run_cluster(config) as cluster:
        yield cluster


def _node_id(_actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def _node_of_worker(cluster: ClusterHandle, pool: str) -> str:
    handle = ray.get(cluster.controller.worker_handle.remote(pool, 0), timeout=30)
    return ray.get(handle.__ray_call__.remote(_node_id), timeout=30)  # type: ignore[no-any-return]


def test_prefill_and_decode_run_on_different_nodes_each_with_its_own_store(served, two_nodes):
    prefill_node, decode_node = _node_of_worker(served, "prefill"), _node_of_worker(served, "decode")
    assert prefill_node != decode_node
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert {prefill_node, decode_node} == alive
    stores = served.status()["stores"]
    assert len(stores) == 2 and len({store["address"] for store in stores}) == 2, stores


def test_tokens_through_the_gateway_equal_the_offline_engine(served, model_path):
    client = openai_client(served.gateway_url)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        tokens = list(pool.map(lambda args: complete(client, *args), zip(PROMPTS, PARAMS)))
    llm = LLM(model=str(model_path), kv_cache_memory_bytes=16 * 2**20, max_num_seqs=8)
    params = [SamplingParams(ignore_eos=True, **p) for p in PARAMS]
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    offline = [list(out.outputs[0].token_ids) for out in outputs]
    assert tokens == offline
    assert [len(t) for t in tokens] == [p["max_tokens"] for p in PARAMS]


def test_every_worker_is_idle_and_both_stores_empty_afterwards(served):
    assert_idle(served)


def _store_of_node(cluster: ClusterHandle, node_id: str) -> dict[str, Any]:
    (row,) = [store for store in cluster.status()["stores"] if store["node_id"] == node_id]
    return row  # type: ignore[no-any-return]


def _releases(address: str) -> int:
    """Keys the store freed on Release: the decode releases a request's state where it read it."""
    with StateStoreClient(address) as store:
        return store.stats().num_releases


def test_the_state_took_one_hop_from_the_prefill_node_store(served, two_nodes):
    prefill_store = _store_of_node(served, _node_of_worker(served, "prefill"))["address"]
    decode_store = _store_of_node(served, _node_of_worker(served, "decode"))["address"]
    before = _releases(prefill_store), _releases(decode_store)
    client = openai_client(served.gateway_url)
    assert len(complete(client, PROMPTS[1], PARAMS[1])) == PARAMS[1]["max_tokens"]
    after = _releases(prefill_store), _releases(decode_store)
    assert after[0] == before[0] + 1, "the request's state was not read from the prefill node's store"
    assert after[1] == before[1], "the decode node's store held the state: it took two hops"


def test_killing_the_prefill_node_store_mid_transfer_serves_the_request_elsewhere(served, faults):
    """The prefill's write fails with its store: the gateway runs the prompt again, on the decode
    worker (prefill.fallback: decode_local needs no store), so the client still gets its answer."""
    store = _store_of_node(served, _node_of_worker(served, "prefill"))
    faults.arm(hold_puts=True, key_prefix="decode")  # the state stalls in the prefill node's store
    url = served.gateway_url or ""
    body = {"model": "tiny", "prompt": list(range(40, 140)), "max_tokens": 6, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=180.0)
        try:
            wait_for(lambda: any(hit[0] == "hold" for hit in faults.hits()), "the state on its way")
            os.kill(store["pid"], signal.SIGKILL)
            response = sent.result(timeout=180.0)  # a guard against a hang, not a latency bound
        finally:
            faults.disarm()
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == body["max_tokens"]

    def back() -> bool:
        row = _store_of_node(served, store["node_id"])
        return row["restarts"] > store["restarts"] and row["healthy"]

    wait_for(back, "the prefill node's store restarted")
    client = openai_client(served.gateway_url)
    assert len(complete(client, PROMPTS[0], PARAMS[0])) == PARAMS[0]["max_tokens"]
    assert_idle(served, timeout_s=60)
