"""A prefix computed on prefill worker A is served on prefill worker B through the node's store,
with the tokens of caching off; a lost or corrupt stored piece is recomputed, never served."""

from __future__ import annotations

import dataclasses

import pytest

from decode_worker.actor import DecodeWorkerActor
from prefill_worker.actor import PrefillWorkerActor
from splitserve import SamplingParams, wire
from splitserve.engine.prefix_cache.imported import ImportedPrefix
from splitserve.prefix_hash import prefix_hash_chain
from splitserve.state import StateKind
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.workers import client
from tests.workers.client import generate

UNIT = 16
SALT = "tiny-served-name"  # as a cluster runs: engines name prefixes with the gateway's salt
WAIT_S = 60.0


def _params(seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _turns(first: int) -> tuple[list[int], list[int]]:
    """A first prompt ending inside a unit, and a second turn that re-sends it and goes on."""
    prompt = list(range(first, first + 5 * UNIT + 7))
    return prompt, prompt + list(range(first + 200, first + 230))


@pytest.fixture(scope="module")
def caching_config(engine_config):
    return dataclasses.replace(engine_config, enable_prefix_caching=True, prefix_unit=UNIT, prefix_salt=SALT)


@pytest.fixture
def gateway_chains(monkeypatch):
    """Prefill requests carry the chain the gateway computes (the served name as the salt)."""

    def with_chain(request_id, prompt, params, reservation=None, lease_s=0.0):  # type: ignore[no-untyped-def]
        chain = prefix_hash_chain(prompt, UNIT, SALT.encode())
        return wire.prefill_request(request_id, prompt, params, reservation, lease_s, prefix_hashes=chain)

    monkeypatch.setattr(client, "prefill_request", with_chain)


@pytest.fixture(scope="module")
def node(caching_config):
    """One store, prefill workers A and B and a decode worker, all caching, all on this 'node'."""
    store = StateStore.from_config(StoreConfig(memory_bytes=64 << 20, arena_root=None))
    server = StateStoreServer(store, "127.0.0.1", 0)
    workers = {
        "a": PrefillWorkerActor(caching_config, server.address),
        "b": PrefillWorkerActor(caching_config, server.address),
        "decode": DecodeWorkerActor(caching_config, server.address),
    }
    addresses = {name: w.start("127.0.0.1", 0) for name, w in workers.items()}
    yield store, workers, addresses
    for w in workers.values():
        w.shutdown()
    server.stop(grace_s=0)
    store.close()


def _published_on_a(workers, addresses, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = generate(addresses["a"], addresses["decode"], rid, prompt, params).token_ids
    assert workers["a"].servicer.prefixes.publisher.wait_idle(WAIT_S)
    return tokens


def _imported_tokens(worker) -> int:
    return worker.loop.call(lambda e: e.prefix_cache_stats().num_imported_tokens).result(WAIT_S)


@pytest.mark.parametrize("seeded", [False, True])
def test_a_prefix_computed_on_a_hits_on_b_through_the_store(node, reference, seeded):
    store, workers, addresses = node
    first, second = _turns(100 if seeded else 500)
    params = _params(seeded)
    assert _published_on_a(workers, addresses, f"a-{seeded}", first, params) == reference(first, params)
    assert store.stats().num_prefix_keys >= 1
    fetcher = workers["b"].servicer.prefixes.fetcher
    hits, imported = fetcher.stats.num_hits, _imported_tokens(workers["b"])
    got = generate(addresses["b"], addresses["decode"], f"b-{seeded}", second, params).token_ids
    assert got == reference(second, params)
    assert fetcher.stats.num_hits == hits + 1
    assert _imported_tokens(workers["b"]) == imported + len(first)  # the whole first turn, tail and all
    # B now holds the second turn itself: a third turn hits locally and streams nothing in
    third = second + [9, 8, 7]
    not_longer = fetcher.stats.num_not_longer
    assert generate(
        addresses["b"], addresses["decode"], f"b3-{seeded}", third, params
    ).token_ids == reference(third, params)
    assert fetcher.stats.num_hits == hits + 1 and fetcher.stats.num_not_longer == not_longer + 1
    stats = workers["b"].stats()
    assert stats["prefix_store_hits"] == hits + 1 and stats["prefix_store_lookups"] >= 2
    assert workers["a"].stats()["prefix_published"] >= 1


def test_a_lost_piece_is_not_served_and_the_prompt_is_recomputed(node, reference):
    store, workers, addresses = node
    first, second = _turns(900)
    params = _params(False)
    _published_on_a(workers, addresses, "a-lost", first, params)
    found = store.match_prefix(workers["b"].servicer.prefixes.chain_of(second, None), second[:-1])
    assert found.num_tokens == len(first)
    lost = next(c for c in store.lookup(found.key).chunks if c.kind is StateKind.KDA_RECURRENT)
    store._tiers.remove(lost.id)  # one snapshot piece gone from the tiers
    fetcher = workers["b"].servicer.prefixes.fetcher
    failures, imported = fetcher.stats.num_failures, _imported_tokens(workers["b"])
    got = generate(addresses["b"], addresses["decode"], "b-lost", second, params).token_ids
    assert got == reference(second, params)
    assert fetcher.stats.num_failures == failures + 1 and _imported_tokens(workers["b"]) == imported
    assert store.lookup(found.key) is None  # the store dropped it whole: no longer advertised


def test_a_corrupt_stored_snapshot_is_recomputed_and_counted(node, reference, monkeypatch):
    store, workers, addresses = node
    first, second = _turns(1300)
    params = _params(True)
    _published_on_a(workers, addresses, "a-corrupt", first, params)
    key = store.match_prefix(workers["b"].servicer.prefixes.chain_of(second, None), second[:-1]).key
    real_fetch = store._tiers.fetch

    def corrupting_fetch(cid):  # type: ignore[no-untyped-def]
        data = real_fetch(cid)
        if data is None or cid.key != key or cid.kind is not StateKind.KDA_RECURRENT:
            return data
        return bytes([data[0] ^ 0x10]) + bytes(data[1:])

    monkeypatch.setattr(store._tiers, "fetch", corrupting_fetch)
    fetcher = workers["b"].servicer.prefixes.fetcher
    failures, corruptions = fetcher.stats.num_failures, store.stats().num_corruptions
    got = generate(addresses["b"], addresses["decode"], "b-corrupt", second, params).token_ids
    assert got == reference(second, params)
    assert fetcher.stats.num_failures == failures + 1
    assert store.stats().num_corruptions == corruptions + 1 and store.lookup(key) is None


def test_the_next_turn_hits_the_prompt_and_reply_the_decode_worker_kept(node, reference, gateway_chains):
    store, workers, addresses = node
    first = list(range(1700, 1700 + 3 * UNIT + 2))
    params = _params(False)
    reply = generate(addresses["a"], addresses["decode"], "turn-1", first, params).token_ids
    assert workers["decode"].prefix_publisher.wait_idle(WAIT_S)
    second = first + reply + [11, 12, 13, 14]
    imported = _imported_tokens(workers["b"])
    assert generate(addresses["b"], addresses["decode"], "turn-2", second, params).token_ids == reference(
        second, params
    )
    # everything the first turn computed: its prompt and every reply token but the last sampled one
    assert _imported_tokens(workers["b"]) == imported + len(first) + len(reply) - 1


def test_an_evicted_prefix_is_not_advertised_and_the_prompt_is_computed(node, reference):
    store, workers, addresses = node
    first, second = _turns(1100)
    params = _params(True)
    _published_on_a(workers, addresses, "a-evicted", first, params)
    key = store.match_prefix(workers["b"].servicer.prefixes.chain_of(second, None), second[:-1]).key
    assert key is not None
    evictions = store.stats().num_prefix_evictions
    with store._lock:  # the path a tier takes when it evicts one of the key's pieces for room
        store._evict_locked(key, "the memory tier was full and there is no disk tier")
    fetcher = workers["b"].servicer.prefixes.fetcher
    before = (fetcher.stats.num_lookups, fetcher.stats.num_hits, fetcher.stats.num_failures)
    imported = _imported_tokens(workers["b"])
    got = generate(addresses["b"], addresses["decode"], "b-evicted", second, params).token_ids
    assert got == reference(second, params)
    assert (fetcher.stats.num_lookups, fetcher.stats.num_hits, fetcher.stats.num_failures) == (
        before[0] + 1,
        before[1],
        before[2],
    )  # looked up, nothing advertised: no hit and no failed fetch
    assert _imported_tokens(workers["b"]) == imported
    assert store.stats().num_prefix_evictions == evictions + 1


def test_a_fetched_state_the_engine_refuses_is_computed_instead(node, reference, monkeypatch):
    _, workers, addresses = node
    prompt = list(range(1200, 1200 + 2 * UNIT + 3))
    params = _params(False)
    prefixes = workers["b"].servicer.prefixes
    wrong = ImportedPrefix(UNIT, [bytes(16)], [])  # names another prompt: add_request refuses it
    monkeypatch.setattr(prefixes, "lookup", lambda *args: object())  # a store "holds" it
    monkeypatch.setattr(prefixes, "worth_reading", lambda *args: True)
    monkeypatch.setattr(prefixes, "read", lambda *args: wrong)
    failures, imported = prefixes.fetcher.stats.num_failures, _imported_tokens(workers["b"])
    got = generate(addresses["b"], addresses["decode"], "b-refused", prompt, params).token_ids
    assert got == reference(prompt, params)
    assert prefixes.fetcher.stats.num_failures == failures + 1 and _imported_tokens(workers["b"]) == imported


@pytest.mark.parametrize("seeded", [False, True])
def test_a_reply_shorter_than_a_unit_is_imported_over_the_local_prompt_hit(
    node, reference, gateway_chains, monkeypatch, seeded
):
    """The multi-turn case: the prefill worker holds the previous prompt's end itself, the store
    the decode worker's prompt + reply; with any gain worth a fetch, the next turn imports the
    reply's rows (fewer than a prefix unit) on top of its own hit."""
    _, workers, addresses = node
    monkeypatch.setattr(workers["a"].servicer.prefixes.fetcher, "min_gain_tokens", 1)
    first = list(range(1400 + 80 * seeded, 1400 + 80 * seeded + 3 * UNIT + 5))
    params = _params(seeded)
    reply = generate(addresses["a"], addresses["decode"], f"short-1-{seeded}", first, params).token_ids
    assert workers["decode"].prefix_publisher.wait_idle(WAIT_S)
    assert len(reply) - 1 < UNIT
    second = first + reply + [21, 22, 23]
    stats = lambda: workers["a"].loop.call(lambda e: e.prefix_cache_stats()).result(WAIT_S)  # noqa: E731
    before = stats()
    got = generate(addresses["a"], addresses["decode"], f"short-2-{seeded}", second, params).token_ids
    assert got == reference(second, params)
    after = stats()
    assert after.num_hit_tokens == before.num_hit_tokens + len(first)  # its own prompt-end snapshot
    assert after.num_imported_tokens == before.num_imported_tokens + len(reply) - 1  # the reply's rows
