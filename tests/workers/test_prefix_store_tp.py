"""The cluster prefix cache across tensor-parallel widths: a prefix a TP=2 prefill worker retains
goes to the node's store with every rank's KDA heads, and a TP=1 prefill worker serves a prompt
sharing it from the store (assembling every head), with the greedy tokens of the offline TP=1
engine; and the reverse, each rank of a TP=2 worker taking its heads of a TP=1 worker's prefix."""

from __future__ import annotations

import dataclasses

import pytest

from decode_worker.actor import DecodeWorkerActor
from prefill_worker.actor import PrefillWorkerActor
from splitserve import SamplingParams
from splitserve.state import HeadRange, StateKind
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.workers.client import generate

UNIT = 16
WAIT_S = 60.0
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def node(engine_config):
    """One store; prefill workers at TP=1 and TP=2 caching prefixes; a decode worker that caches
    none (so every stored prefix is a prefill worker's)."""
    caching = dataclasses.replace(engine_config, enable_prefix_caching=True, prefix_unit=UNIT)
    store = StateStore.from_config(StoreConfig(memory_bytes=64 << 20, arena_root=None))
    server = StateStoreServer(store, "127.0.0.1", 0)
    workers = {
        "tp1": PrefillWorkerActor(caching, server.address),
        "tp2": PrefillWorkerActor(dataclasses.replace(caching, tensor_parallel_size=2), server.address),
        "decode": DecodeWorkerActor(engine_config, server.address),
    }
    try:
        addresses = {name: w.start("127.0.0.1", 0) for name, w in workers.items()}
        yield store, workers, addresses
    finally:
        for w in workers.values():
            w.shutdown()
        server.stop(grace_s=0)
        store.close()


def _turns(first: int) -> tuple[list[int], list[int]]:
    """A first prompt ending inside a unit, and a second turn that re-sends it and goes on."""
    prompt = list(range(first, first + 4 * UNIT + 5))
    return prompt, prompt + list(range(first + 300, first + 320))


@pytest.mark.parametrize("publisher,importer", [("tp2", "tp1"), ("tp1", "tp2")])
def test_a_prefix_published_at_one_width_is_served_from_the_store_at_another(
    node, reference, publisher, importer
):
    store, workers, addresses = node
    first, second = _turns(100 if publisher == "tp2" else 600)
    published = workers[publisher].stats()["prefix_published"]
    got = generate(addresses[publisher], addresses["decode"], f"{publisher}-first", first, PARAMS)
    assert got.token_ids == reference(first, PARAMS)
    assert workers[publisher].servicer.prefixes.publisher.wait_idle(WAIT_S)
    assert workers[publisher].stats()["prefix_published"] > published
    key = store.match_prefix(workers[importer].servicer.prefixes.chain_of(second, None), second[:-1]).key
    assert key is not None
    heads = {c.heads for c in store.lookup(key).chunks if c.kind is StateKind.KDA_RECURRENT}
    num_heads = workers[publisher].loop.engine.model_config.linear_num_heads
    if publisher == "tp2":  # one piece per rank per KDA state, each naming its heads
        half = num_heads // 2
        assert heads == {HeadRange(0, half, num_heads), HeadRange(half, num_heads, num_heads)}
    else:
        assert heads == {None}
    before = workers[importer].stats()
    got = generate(addresses[importer], addresses["decode"], f"{importer}-second", second, PARAMS)
    assert got.token_ids == reference(second, PARAMS)
    after = workers[importer].stats()
    assert after["prefix_store_hits"] == before["prefix_store_hits"] + 1
    assert after["prefix_store_hit_tokens"] == before["prefix_store_hit_tokens"] + len(first)
    assert after["prefix_store_fetch_failures"] == before["prefix_store_fetch_failures"]
