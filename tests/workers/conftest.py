"""Real gRPC servers on 127.0.0.1 for the workers and a state store, in this process (no Ray)."""

from __future__ import annotations

import pytest

from colocated_worker.actor import ColocatedWorkerActor
from decode_worker.actor import DecodeWorkerActor
from prefill_worker.actor import PrefillWorkerActor
from splitserve import LLM, SamplingParams
from splitserve.engine_config import EngineConfig
from splitserve.tiny_model import make_tiny_model
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def engine_config(model_path):
    return EngineConfig(model=str(model_path), max_model_len=512, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def reference(engine_config):
    """The offline engine (TP=1), caching off: the tokens every run must give."""
    llm = LLM(model=engine_config.model, max_model_len=512)

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        return llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids

    return run


@pytest.fixture(scope="module")
def store_server():
    store = StateStore.from_config(StoreConfig(memory_bytes=64 << 20))
    server = StateStoreServer(store, "127.0.0.1", 0)
    yield store, server.address
    server.stop(grace_s=0)
    store.close()


@pytest.fixture(scope="module")
def cluster(engine_config, store_server):
    """One prefill worker, one decode worker and one colocated worker, all real servers."""
    _, store_address = store_server
    workers = {
        "prefill": PrefillWorkerActor(engine_config, store_address),
        "decode": DecodeWorkerActor(engine_config, store_address),
        "colocated": ColocatedWorkerActor(engine_config),
    }
    addresses = {name: w.start("127.0.0.1", 0) for name, w in workers.items()}
    yield workers, addresses
    for w in workers.values():
        w.shutdown()
