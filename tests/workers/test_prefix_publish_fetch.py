"""A retained prefix's state through a real store server: published off the engine thread,
registered only once whole, fetched back bit-exact, and never served partial or corrupt."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.prefix_cache.retained import RetainedPrefix
from splitserve.engine.state_transfer import LayerState
from splitserve.prefix_hash import prefix_hash_chain
from splitserve.state import StateKind
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import StateEvictedError
from splitserve.state.records import NO_PREFIX_MATCH, PrefixMatch
from splitserve.worker.prefix_store.fetcher import PrefixFetcher
from splitserve.worker.prefix_store.publisher import PrefixPublisher
from state_store.config import StoreConfig
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.store import StateStore

UNIT = 16
MLA_LAYERS, KDA_LAYERS = (1, 3), (0, 2)
PROMPT = list(range(1000, 1000 + 3 * UNIT + 10))  # 3 whole units and 10 tokens more
WAIT_S = 30.0


def _caches() -> LayerCaches:
    return LayerCaches(
        mla_kv={layer: torch.zeros(256, 12, dtype=torch.bfloat16) for layer in MLA_LAYERS},
        kda_conv={layer: torch.zeros(4, 24, 3) for layer in KDA_LAYERS},
        kda_recurrent={layer: torch.zeros(4, 2, 6, 6) for layer in KDA_LAYERS},
    )


def _retained(num_tokens: int, seed: int = 0) -> RetainedPrefix:
    gen = torch.Generator().manual_seed(seed)
    states = [
        LayerState(
            layer, StateKind.MLA_KV, torch.randn(num_tokens, 12, generator=gen).bfloat16(), 0, num_tokens
        )
        for layer in MLA_LAYERS
    ]
    for layer in KDA_LAYERS:
        states.append(LayerState(layer, StateKind.KDA_CONV, torch.randn(24, 3, generator=gen), 0, num_tokens))
        states.append(
            LayerState(layer, StateKind.KDA_RECURRENT, torch.randn(2, 6, 6, generator=gen), 0, num_tokens)
        )
    num_units = num_tokens // UNIT
    chain = prefix_hash_chain(PROMPT[:num_tokens], UNIT)
    return RetainedPrefix(chain[:num_units], num_tokens, PROMPT[num_units * UNIT : num_tokens], states)


def _by_layer(states: list[LayerState]) -> dict[tuple[int, StateKind], torch.Tensor]:
    return {(s.layer_id, StateKind(s.kind)): s.tensor for s in states}


def _serve(arena_root: str | None) -> Iterator[tuple[StateStore, StateStoreClient]]:
    store = StateStore.from_config(StoreConfig(memory_bytes=16 << 20, arena_root=arena_root))
    server = StateStoreServer(store, "127.0.0.1", 0)
    client = StateStoreClient(server.address, timeout_s=WAIT_S)
    yield store, client
    client.close()
    server.stop(grace_s=0)
    store.close()


@pytest.fixture
def served() -> Iterator[tuple[StateStore, StateStoreClient]]:
    """A store whose state moves as bytes over gRPC (its damage can be injected in its tiers)."""
    yield from _serve(None)


@pytest.fixture
def served_arena(tmp_path) -> Iterator[tuple[StateStore, StateStoreClient]]:
    """A store sharing this node: pieces are written into and read from its arena's regions."""
    yield from _serve(str(tmp_path / "arena"))


@pytest.mark.parametrize("path", ["bytes", "arena"])
def test_both_state_paths_give_back_the_published_state(path, request) -> None:
    store, client = request.getfixturevalue("served" if path == "bytes" else "served_arena")
    prefix = _retained(2 * UNIT + 3, seed=4)
    _publish(client, prefix).close()
    key = store.match_prefix(prefix.hash_chain, PROMPT).key
    assert key is not None and bool(store._entries[key].regions) == (path == "arena")
    imported = PrefixFetcher(_caches()).fetch([client], prefix_hash_chain(PROMPT, UNIT), PROMPT)
    assert imported is not None and imported.num_tokens == 2 * UNIT + 3
    got, want = _by_layer(imported.states), _by_layer(prefix.states)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_region_damaged_in_the_arena_is_refused_and_no_longer_advertised(served_arena) -> None:
    store, client = served_arena
    _publish(client, _retained(2 * UNIT)).close()
    key = store.match_prefix(prefix_hash_chain(PROMPT, UNIT)).key
    entry = store._entries[key]
    cid = next(c for c in entry.order if c.kind is StateKind.KDA_RECURRENT)
    region, offset = entry.locations[cid]
    region.view[offset] ^= 0x01  # a reader on the node checks the checksum, not the store
    fetcher = PrefixFetcher(_caches())
    assert fetcher.fetch([client], prefix_hash_chain(PROMPT, UNIT), PROMPT) is None
    assert fetcher.stats.num_failures == 1
    assert store.lookup(key) is None and store.match_prefix(prefix_hash_chain(PROMPT, UNIT)).key is None


def _publish(client: StateStoreClient, *prefixes: RetainedPrefix) -> PrefixPublisher:
    publisher = PrefixPublisher(client, "prefill-a")
    for prefix in prefixes:
        publisher.offer(prefix)
    assert publisher.wait_idle(WAIT_S)
    return publisher


def test_a_published_prefix_is_fetched_back_exactly_with_its_tail(served) -> None:
    store, client = served
    whole, with_tail = _retained(2 * UNIT, seed=1), _retained(3 * UNIT + 5, seed=2)
    publisher = _publish(client, whole, with_tail, _retained(3, seed=3))  # under one unit: not published
    assert (publisher.stats.num_published, publisher.stats.num_too_short) == (2, 1)
    publisher.close()
    fetcher = PrefixFetcher(_caches())
    chain = prefix_hash_chain(PROMPT, UNIT)
    imported = fetcher.fetch([client], chain, PROMPT)
    assert imported is not None and imported.num_tokens == 3 * UNIT + 5
    assert imported.hash_chain == chain[:3]
    got, want = _by_layer(imported.states), _by_layer(with_tail.states)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # a prompt that differs inside the tail gets the whole-unit state; the local cache may beat it
    other = PROMPT[: 3 * UNIT] + [7] * 10
    assert fetcher.fetch([client], chain, other).num_tokens == 2 * UNIT
    assert fetcher.fetch([client], chain, other, lambda: 2 * UNIT) is None
    stats = fetcher.stats
    assert (stats.num_lookups, stats.num_hits, stats.num_not_longer, stats.num_failures) == (3, 2, 1, 0)
    assert stats.num_hit_tokens == 5 * UNIT + 5
    assert store.stats().num_prefix_keys == 2


def test_a_stored_state_is_read_only_when_it_saves_enough_over_the_local_hit(served) -> None:
    _, client = served
    _publish(client, _retained(3 * UNIT)).close()
    fetcher = PrefixFetcher(_caches(), min_gain_tokens=UNIT)
    chain = prefix_hash_chain(PROMPT, UNIT)
    assert fetcher.fetch([client], chain, PROMPT, lambda: 3 * UNIT - 5) is None  # 5 more: not worth it
    assert fetcher.fetch([client], chain, PROMPT, lambda: 2 * UNIT).num_tokens == 3 * UNIT
    assert fetcher.fetch([client], chain, PROMPT).num_tokens == 3 * UNIT  # nothing local: any hit
    assert (fetcher.stats.num_not_longer, fetcher.stats.num_hits) == (1, 2)


def test_a_prefix_the_store_already_holds_is_not_written_again(served) -> None:
    store, client = served
    publisher = _publish(client, _retained(2 * UNIT), _retained(2 * UNIT, seed=5))
    assert (publisher.stats.num_published, publisher.stats.num_already_stored) == (1, 1)
    publisher.close()
    assert store.stats().num_prefix_keys == 1


def test_a_corrupt_piece_is_refused_counted_and_forgotten(served, monkeypatch) -> None:
    store, client = served
    _publish(client, _retained(2 * UNIT)).close()
    real_fetch = store._tiers.fetch

    def corrupting_fetch(cid):  # type: ignore[no-untyped-def]
        data = real_fetch(cid)
        hit = data is not None and cid.kind is StateKind.KDA_RECURRENT and cid.layer == KDA_LAYERS[-1]
        return bytes([data[0] ^ 1]) + bytes(data[1:]) if hit else data

    monkeypatch.setattr(store._tiers, "fetch", corrupting_fetch)
    fetcher = PrefixFetcher(_caches())
    chain = prefix_hash_chain(PROMPT, UNIT)
    assert fetcher.fetch([client], chain, PROMPT) is None
    assert fetcher.stats.num_failures == 1
    assert fetcher.fetch([client], chain, PROMPT) is None  # forgotten: no longer advertised
    assert fetcher.stats.num_failures == 1
    assert store.stats().num_corruptions == 1 and store.stats().num_prefix_keys == 0


def test_a_state_of_another_shape_is_refused(served) -> None:
    _, client = served
    _publish(client, _retained(2 * UNIT)).close()
    caches = _caches()
    caches.kda_recurrent = {layer: torch.zeros(4, 2, 6, 7) for layer in KDA_LAYERS}
    fetcher = PrefixFetcher(caches)
    assert fetcher.fetch([client], prefix_hash_chain(PROMPT, UNIT), PROMPT) is None
    assert fetcher.stats.num_failures == 1


def test_evicting_one_piece_shortens_what_is_advertised() -> None:
    store = StateStore(MemoryTier(1 << 20), prefix_budget_bytes=None)
    server = StateStoreServer(store, "127.0.0.1", 0)
    client = StateStoreClient(server.address, timeout_s=WAIT_S)
    try:
        _publish(client, _retained(UNIT), _retained(3 * UNIT)).close()
        long_key = store.match_prefix(prefix_hash_chain(PROMPT, UNIT)).key
        assert long_key is not None
        chunk_id = store.lookup(long_key).chunks[-1].id
        store._tiers.remove(chunk_id)  # one piece gone (as a failed disk read would lose it)
        with pytest.raises(StateEvictedError, match="in no tier"):
            list(store.get(long_key))  # the store drops the whole key and forgets its prefix
        imported = PrefixFetcher(_caches()).fetch([client], prefix_hash_chain(PROMPT, UNIT), PROMPT)
        assert imported is not None and imported.num_tokens == UNIT
    finally:
        client.close()
        server.stop(grace_s=0)
        store.close()


class _SlowClient:
    """Stands in for a store whose writes hang until released."""

    address = "slow"

    def __init__(self) -> None:
        self.release = threading.Event()

    def match_prefix(self, *args: object) -> PrefixMatch:
        self.release.wait(WAIT_S)
        return NO_PREFIX_MATCH

    def open_put(self, *args: object, **kwargs: object) -> _SlowClient:
        return self  # and stands in for its put stream: takes everything at once

    def write_state(self, *args: object, **kwargs: object) -> None:
        return None

    def finish(self, timeout_s: float) -> tuple[int, int]:
        return (0, 0)

    def register(self, *args: object, **kwargs: object) -> None:
        return None


def test_a_slow_store_drops_prefixes_instead_of_blocking_the_engine() -> None:
    slow = _SlowClient()
    publisher = PrefixPublisher(slow, "prefill-a", max_pending=2)  # type: ignore[arg-type]
    for seed in range(6):
        publisher.offer(_retained(UNIT, seed=seed))  # returns at once even though nothing is written
    slow.release.set()
    assert publisher.wait_idle(WAIT_S)
    stats = publisher.stats
    assert stats.num_dropped >= 3 and stats.num_published + stats.num_dropped == 6
    publisher.close()
