"""The store as a prefix cache: registered prefixes with tails, kept without a lease, evicted
least recently hit first, forgotten whole when any piece goes, counted; over gRPC too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitserve.state.client import StateStoreClient
from splitserve.state.errors import CorruptStateError, StoreFullError
from splitserve.state.records import PrefixMatch
from state_store.arena import Arena
from state_store.memory_tier import MemoryTier
from state_store.prefix_index import PrefixIndex
from state_store.store import StateStore
from tests.state_store.conftest import FakeClock, make_chunk

CHAIN = [b"u0", b"u1", b"u2", b"u3"]
UNIT = 4  # tokens per unit in these tests' token lists
TOKENS = list(range(100, 100 + 4 * UNIT + 3))


def _put_sealed(store: StateStore, key: str, num_chunks: int = 2, size: int = 1000) -> None:
    for i in range(num_chunks):
        store.put(make_chunk(key, layer=i, size=size), owner="prefix-cache", final=i == num_chunks - 1)


@pytest.fixture
def store(clock: FakeClock) -> Iterator[StateStore]:
    made = StateStore(MemoryTier(1 << 20), clock=clock, default_lease_s=5.0, prefix_budget_bytes=10_000)
    yield made
    made.close()


def test_a_tail_matches_only_a_query_whose_tokens_continue_with_it() -> None:
    index = PrefixIndex()
    always = lambda key: True  # noqa: E731
    index.register(CHAIN[:2], "two-units", num_tokens=2 * UNIT)
    index.register(CHAIN[:2], "two-units+3", TOKENS[8:11], num_tokens=2 * UNIT + 3)
    assert index.longest_match(CHAIN, always, TOKENS) == PrefixMatch(2, "two-units+3", 11)
    other = TOKENS[:9] + [0] + TOKENS[10:]  # differs inside the tail
    assert index.longest_match(CHAIN, always, other) == PrefixMatch(2, "two-units", 8)
    assert index.longest_match(CHAIN, always, TOKENS[:10]) == PrefixMatch(2, "two-units", 8)  # too short
    assert index.longest_match(CHAIN, always) == PrefixMatch(2, "two-units", 8)  # no tokens: no tails
    index.forget("two-units")
    assert index.longest_match(CHAIN, always) == PrefixMatch(0, None, 0)
    with pytest.raises(ValueError, match="needs num_tokens"):
        index.register(CHAIN[:1], "bad", [1, 2])


def test_a_registered_prefix_outlives_its_lease_and_is_counted(store: StateStore, clock: FakeClock) -> None:
    _put_sealed(store, "p")
    _put_sealed(store, "handoff")
    store.register(CHAIN[:3], "p", tail_token_ids=TOKENS[12:14], num_tokens=14)
    clock.advance(60.0)  # past every lease: the handoff key expires, the retained prefix does not
    assert store.lookup("handoff") is None
    assert store.match_prefix(CHAIN, TOKENS) == PrefixMatch(3, "p", 14)
    assert store.match_prefix([b"x"], TOKENS) == PrefixMatch(0, None, 0)
    stats = store.stats()
    assert (stats.num_prefix_lookups, stats.num_prefix_hits, stats.num_prefix_hit_tokens) == (2, 1, 14)
    assert (stats.num_prefix_keys, stats.num_prefix_bytes, stats.num_expiries) == (1, 2000, 1)
    store.release(key="p")  # a release is not an eviction
    assert store.match_prefix(CHAIN, TOKENS).key is None
    assert (store.stats().num_prefix_evictions, store.stats().num_prefix_keys) == (0, 0)


def test_the_budget_evicts_the_least_recently_hit_prefix_first(store: StateStore) -> None:
    for units, key in enumerate(("a", "b", "c", "d"), start=1):  # 2000 bytes each, budget 10000
        _put_sealed(store, key)
        store.register(CHAIN[:units], key, num_tokens=units * UNIT)
    assert store.match_prefix(CHAIN[:1]).key == "a"  # a is now the most recently hit
    _put_sealed(store, "e", num_chunks=3)  # 3000 more: 11000 > 10000, b (least recent) goes
    store.register([b"other"], "e")
    assert store.lookup("b") is None
    assert store.match_prefix(CHAIN[:2]) == PrefixMatch(1, "a", UNIT)  # advertised shorter
    assert store.match_prefix(CHAIN) == PrefixMatch(4, "d", 4 * UNIT)
    stats = store.stats()
    assert (stats.num_prefix_evictions, stats.num_prefix_keys, stats.num_prefix_bytes) == (1, 4, 9000)


def test_a_tier_evicting_one_piece_forgets_the_whole_prefix(clock: FakeClock) -> None:
    store = StateStore(MemoryTier(5000), clock=clock)  # no disk: the memory tier's evictions are lost
    try:
        _put_sealed(store, "p")
        store.register(CHAIN[:2], "p", num_tokens=2 * UNIT)
        store.put(make_chunk("handoff", size=3500), owner="prefill-0")  # evicts p's oldest chunk
        assert store.match_prefix(CHAIN) == PrefixMatch(0, None, 0)
        assert store.lookup("p") is None
        assert store.stats().num_prefix_evictions == 1
    finally:
        store.close()


def test_a_corrupt_piece_forgets_the_prefix(store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    _put_sealed(store, "p")
    store.register(CHAIN[:2], "p", num_tokens=2 * UNIT)
    real_fetch = store._tiers.fetch

    def corrupting_fetch(cid):  # type: ignore[no-untyped-def]
        data = real_fetch(cid)
        return bytes([data[0] ^ 1]) + bytes(data[1:]) if data and cid.layer == 1 else data

    monkeypatch.setattr(store._tiers, "fetch", corrupting_fetch)
    with pytest.raises(CorruptStateError):
        list(store.get("p"))
    assert store.match_prefix(CHAIN).key is None
    stats = store.stats()
    assert (stats.num_corruptions, stats.num_prefix_evictions, stats.num_prefix_keys) == (1, 1, 0)


def test_register_and_lookup_with_tails_over_grpc(client: StateStoreClient) -> None:
    client.put([make_chunk("p", 0), make_chunk("p", 1)], owner="prefix-cache", seal=True)
    client.register(CHAIN[:3], "p", tail_token_ids=TOKENS[12:15], num_tokens=15)
    assert client.match_prefix(CHAIN, TOKENS) == PrefixMatch(3, "p", 15)
    assert client.match_prefix(CHAIN, TOKENS[:14]) == PrefixMatch(0, None, 0)  # tail longer than query
    assert client.match_prefix(CHAIN) == PrefixMatch(0, None, 0)  # no tokens: no tail matches
    info = client.lookup("p")
    assert info is not None and info.lease_remaining_s > 1e9  # retained: no lease expiry
    stats = client.stats()
    assert (stats.num_prefix_lookups, stats.num_prefix_hit_tokens, stats.num_prefix_keys) == (3, 15, 1)
    assert stats.num_prefix_bytes == 2048


def test_state_in_flight_takes_the_room_of_retained_prefixes_in_the_arena(tmp_path, clock: FakeClock) -> None:
    """Arena regions are pinned (the tiers cannot evict them): retained ones give way instead."""
    store = StateStore(MemoryTier(5000), clock=clock, arena=Arena(tmp_path / "arena"))
    try:
        for key in ("old", "new"):
            region = store.allocate(key, owner="prefix-cache", num_bytes=2000)
            store.put_region(make_chunk(key, size=2000).meta, region, 0, owner="prefix-cache", final=True)
            store.register([key.encode()], key, num_tokens=UNIT)
        store.match_prefix([b"old"])  # "old" is hit last: "new" is now the least recently used
        store.allocate("handoff", owner="prefill-0", num_bytes=2500)  # 6500 > 5000: one must go
        assert store.match_prefix([b"new"]).key is None and store.lookup("new") is None
        assert store.match_prefix([b"old"]).key == "old"
        assert store.stats().num_prefix_evictions == 1
        with pytest.raises(StoreFullError):  # nothing retained is left to give way
            store.allocate("handoff-2", owner="prefill-0", num_bytes=2600)
    finally:
        store.close()
