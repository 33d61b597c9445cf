"""The memory tier spills what it evicts to disk; reads come back exact from either tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.state.errors import StateEvictedError, StoreFullError
from state_store.disk_tier import DiskTier
from state_store.memory_tier import MemoryTier
from state_store.store import StateStore
from tests.state_store.conftest import make_chunk


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    made = StateStore(MemoryTier(4096), DiskTier(tmp_path, 8192))
    yield made
    made.close()


def test_evicted_chunks_spill_to_disk_and_read_back_exactly(store: StateStore) -> None:
    chunks = [make_chunk("req", layer, size=1024) for layer in range(8)]
    for i, chunk in enumerate(chunks):
        store.put(chunk, owner="w", final=i == len(chunks) - 1)
    stats = store.stats()
    memory, disk = stats.tiers
    assert (memory.num_objects, disk.num_objects) == (4, 4)
    assert (memory.num_keys, disk.num_keys) == (1, 1)  # one key, its chunks split over both tiers
    assert stats.num_spills == 4 and stats.num_evictions == 0
    assert [c.data for c in store.get("req")] == [c.data for c in chunks]
    store.release("req")
    assert [(t.num_keys, t.num_objects) for t in store.stats().tiers] == [(0, 0), (0, 0)]


def test_a_chunk_too_big_for_memory_goes_straight_to_disk(store: StateStore) -> None:
    big = make_chunk("req", size=6000)
    store.put(big, owner="w", final=True)
    memory, disk = store.stats().tiers
    assert (memory.num_bytes, disk.num_bytes) == (0, 6000)
    assert next(store.get("req")).data == big.data


def test_when_disk_overflows_the_oldest_key_is_evicted_whole(store: StateStore) -> None:
    for layer in range(6):
        store.put(make_chunk("old", layer, size=1024), owner="w")
    for layer in range(8):
        store.put(make_chunk("new", layer, size=1024), owner="w")
    with pytest.raises(StateEvictedError, match="'old' was evicted"):
        list(store.get("old"))
    stats = store.stats()
    assert stats.num_evictions == 1
    assert store.lookup("old") is None
    new = store.lookup("new")
    assert new is not None and new.num_bytes == 8 * 1024
    assert stats.num_bytes == 8 * 1024


def test_pinned_keys_stay_in_memory(store: StateStore) -> None:
    for layer in range(4):
        store.put(make_chunk("hot", layer, size=1024), owner="w")
    store.pin("hot")
    store.put(make_chunk("cold", 0, size=1024), owner="w")
    memory, disk = store.stats().tiers
    assert disk.num_objects == 1 and memory.num_pinned == 4  # cold went straight to disk
    store.unpin("hot")
    store.put(make_chunk("cold", 1, size=1024), owner="w")
    assert store.stats().tiers[1].num_objects == 2


def test_without_room_anywhere_the_put_fails_and_stores_nothing(tmp_path: Path) -> None:
    store = StateStore(MemoryTier(1024))
    try:
        store.put(make_chunk("a", size=1024), owner="w")
        store.pin("a")
        with pytest.raises(StoreFullError, match="no disk tier"):
            store.put(make_chunk("b", size=1024), owner="w")
        b = store.lookup("b")
        assert b is not None and b.num_bytes == 0  # the key exists, empty; its lease reclaims it
        assert store.stats().num_bytes == 1024
    finally:
        store.close()
