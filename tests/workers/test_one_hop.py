"""One hop across nodes, in one process: two stores stand for two nodes, A beside the prefill
worker and B beside the decode worker. Reserved with `source_store_address` = A (as the gateway
reserves once it knows the prefill's node store), the prefill writes A through its arena and the
decode reads A: as gRPC bytes (A is not its node's store, though its arena could be mapped here),
or through Mooncake Transfer Engine when the stores serve it. The tokens equal the offline
engine's; A frees the key and B never held it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from decode_worker.actor import DecodeWorkerActor
from prefill_worker.actor import PrefillWorkerActor
from splitserve import LLM, SamplingParams
from splitserve.rpc import make_channel
from splitserve.state.client import StateStoreClient
from splitserve.v1 import decode_pb2, decode_pb2_grpc
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.state_store.test_mooncake_transport import _mooncake_missing
from tests.workers.client import generate

PROMPT = list(range(20, 120))
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module", params=["none", "mooncake"])
def nodes(request: pytest.FixtureRequest, engine_config: Any) -> Iterator[dict[str, Any]]:
    engine = request.param
    if engine == "mooncake" and (why := _mooncake_missing()) is not None:
        pytest.skip(f"mooncake unusable: {why}")
    stores, servers = [], []
    for _ in range(2):
        stores.append(StateStore.from_config(StoreConfig(memory_bytes=64 << 20, transfer_engine=engine)))
        servers.append(StateStoreServer(stores[-1], "127.0.0.1", 0))
    prefill = PrefillWorkerActor(engine_config, servers[0].address)
    decode = DecodeWorkerActor(engine_config, servers[1].address)
    try:
        yield {
            "engine": engine,
            "store_a": servers[0].address,
            "store_b": servers[1].address,
            "prefill": prefill.start("127.0.0.1", 0),
            "decode": decode.start("127.0.0.1", 0),
            "decode_actor": decode,
        }
    finally:
        for worker in (prefill, decode):
            worker.shutdown()
        for server, store in zip(servers, stores):
            server.stop(grace_s=0)
            store.close()


def _stats(address: str) -> Any:
    with StateStoreClient(address) as client:
        return client.stats()


def test_the_decode_reads_the_prefill_node_store(nodes: dict[str, Any], model_path: Any) -> None:
    a, b = nodes["store_a"], nodes["store_b"]
    before = _stats(a).num_releases, _stats(b).num_releases
    with make_channel(nodes["decode"]) as channel:
        reserved = decode_pb2_grpc.DecodeStub(channel).Reserve(
            decode_pb2.ReserveRequest(
                request_id="r1", num_prompt_tokens=len(PROMPT), timeout_s=30, source_store_address=a
            ),
            timeout=30,
        )
    assert reserved.accepted and reserved.store_address == a  # the prefill writes where it runs
    result = generate(nodes["prefill"], nodes["decode"], "r1", PROMPT, PARAMS, reserved)
    offline = LLM(model=str(model_path)).generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)
    assert result.token_ids == list(offline[0].outputs[0].token_ids)
    assert result.timing is not None and result.timing.state_bytes > 0
    after = _stats(a), _stats(b)
    assert after[0].num_releases == before[0] + 1 and after[0].num_keys == 0
    assert after[1].num_releases == before[1] and after[1].num_keys == 0 and after[1].num_hits == 0
    transport = nodes["decode_actor"].servicer.transport
    assert (transport is not None and transport.engine == "mooncake") == (nodes["engine"] == "mooncake")
    # what the decode worker's stats (and `splitserve status`) say of it
    expected = "mooncake" if nodes["engine"] == "mooncake" else "grpc"
    assert nodes["decode_actor"].stats()["cross_node_transport"] == expected
