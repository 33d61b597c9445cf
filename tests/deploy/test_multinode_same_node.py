"""Same-node preference on two Ray nodes (two raylets on this machine): one prefill worker and a
decode worker on each node (STRICT_SPREAD). The controller tells the gateway each worker's node
store, so with both decode workers equally idle a request is decoded beside its prefill and its
state never leaves the node; the tokens equal the offline engine's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from deploy.launcher import ClusterHandle, run_cluster
from splitserve import LLM, SamplingParams
from splitserve.config import parse_config
from splitserve.tiny_model import make_tiny_model
from tests.deploy.conftest import two_node_cluster
from tests.e2e.helpers import MODEL, TOKEN_IDS, assert_idle, openai_client, token_ids, worker_stats
from tests.faults.conftest import wait_for

NUM_CPUS_PER_NODE = 2
# node of the prefill: prefill 1 + decode 0.5 + store 0.25 (+ the gateway's 0.25 on the head)
PREFILL = {"num_cpus": 1, "kv_cache_memory_bytes": "16MiB", "max_num_seqs": 8}
DECODE = {**PREFILL, "num_cpus": 0.5, "replicas": 2, "placement": "STRICT_SPREAD"}
PROMPT = list(range(40, 140))
MAX_TOKENS = 400  # long enough to still run when the decode workers are looked at
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("same-node-model"), seed=9)


@pytest.fixture(scope="module")
def served(model_path: Path) -> Iterator[ClusterHandle]:
    config = parse_config(
        {
            "model": {"path": str(model_path), "name": MODEL},
            "gateway": {"port": 0},
            "prefill": PREFILL,
            "decode": DECODE,
            "store": {"memory_bytes": "64MiB", "disk": {"path": None}},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300},
        }
    )
    with two_node_cluster(NUM_CPUS_PER_NODE) as _cluster, run_cluster(config) as cluster:
        yield cluster


def _node_id(_actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def _node_of(cluster: ClusterHandle, pool: str, index: int) -> str:
    handle = ray.get(cluster.controller.worker_handle.remote(pool, index), timeout=30)
    return ray.get(handle.__ray_call__.remote(_node_id), timeout=30)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def offline(model_path: Path) -> list[int]:
    llm = LLM(model=str(model_path), kv_cache_memory_bytes=16 * 2**20, max_num_seqs=8)
    return list(llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0].outputs[0].token_ids)


def test_the_decode_beside_the_prefill_takes_the_request(served: ClusterHandle, offline: list[int]) -> None:
    prefill_node = _node_of(served, "prefill", 0)
    decode_nodes = [_node_of(served, "decode", i) for i in range(2)]
    assert set(decode_nodes) == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    near = decode_nodes.index(prefill_node)
    client = openai_client(served.gateway_url)
    for _ in range(3):  # each ends before the next: both decode workers idle at every choice
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            logprobs=0,
            extra_body=TOKEN_IDS,
        )
        tokens: list[int] = []
        looked = False
        for chunk in stream:
            tokens += token_ids(chunk.choices[0])
            if len(tokens) >= 2 and not looked:  # decoding now: on which worker?
                wait_for(lambda: worker_stats(served, "decode", near)["num_running"] == 1, "near decode")
                assert worker_stats(served, "decode", 1 - near)["num_running"] == 0
                looked = True
        assert looked and tokens == offline
    assert_idle(served, timeout_s=60)
