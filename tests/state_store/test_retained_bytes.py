"""The store counts what its retained prefixes hold as they change, never by summing every key:
after any seeded random mix of puts, region commits, registrations, hits, releases, expiries and
evictions, the running counts equal the counts taken from scratch."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from pathlib import Path

from splitserve.state.errors import StateStoreError
from splitserve.state.shm import SPARE_PREFIX
from state_store.arena import Arena
from state_store.disk_tier import DiskTier
from state_store.memory_tier import MemoryTier
from state_store.retained import RetainedPrefixes
from state_store.store import StateStore
from tests.state_store.conftest import FakeClock, make_chunk

OWNERS = ("prefix-cache", "prefill-0")
NUM_STEPS = 400
NUM_SEEDS = 6


def _owner(key: str) -> str:
    return OWNERS[len(key) % 2]  # two owners, so a release by owner frees some keys, not all


def _check_counts(store: StateStore, where: str) -> None:
    """The running counts against counts from scratch (the store's internals, read under its lock)."""
    with store._lock:
        entries = store._entries
        for entry in entries.values():
            assert entry.held_bytes == entry.count_held_bytes(), f"{where}: {entry.key}"
        retained = store._retained.keys()
        assert all(key in entries for key in retained)
        brute_force = sum(entries[key].count_held_bytes() for key in retained)
        for key in retained:
            assert store._retained.size_of(key) == entries[key].held_bytes, f"{where}: {key}"
    stats = store.stats()
    assert (stats.num_prefix_bytes, stats.num_prefix_keys) == (brute_force, len(retained)), where


class _RandomWorkload:
    """One seeded run of store calls; each step may fail as the store says (full, sealed, gone)."""

    def __init__(self, store: StateStore, clock: FakeClock, seed: int) -> None:
        self.store, self.clock, self.rng = store, clock, random.Random(seed)
        self.keys: list[str] = []  # the keys put so far that the store still holds
        self.num_names = 0
        self.regions: dict[str, list[tuple[str, int]]] = {}  # key -> (region, bytes) allocated
        self.num_chunks: dict[str, int] = {}

    def step(self) -> None:
        actions = (self.put, self.put_region, self.register, self.hit, self.release, self.expire, self.seal)
        (action,) = self.rng.choices(actions, weights=(4, 4, 4, 2, 1, 2, 2))
        with contextlib.suppress(StateStoreError):  # the store refused (full, sealed, gone):
            action()  # the counts must hold all the same

    def _key(self, new_probability: float = 0.3) -> str:
        """A key still in the store (mostly a recent one), or a new name."""
        self.keys = [key for key in self.keys if key in self.store._entries]
        if not self.keys or self.rng.random() < new_probability:
            prefix = SPARE_PREFIX if self.rng.random() < 0.1 else "k"
            self.num_names += 1
            self.keys.append(f"{prefix}{self.num_names}")
        return self.rng.choice(self.keys[-8:])

    def _next_index(self, key: str) -> int:
        index = self.num_chunks.get(key, 0)
        self.num_chunks[key] = index + 1
        return index

    def put(self) -> None:
        key = self._key()
        chunk = make_chunk(key, index=self._next_index(key), num_chunks=99, size=self.rng.randint(100, 3000))
        self.store.put(chunk, owner=_owner(key), final=self.rng.random() < 0.3)

    def put_region(self) -> None:
        key = self._key()
        regions = self.regions.setdefault(key, [])
        if not regions or self.rng.random() < 0.4:
            size = self.rng.randint(1000, 6000)
            regions.append((self.store.allocate(key, owner=_owner(key), num_bytes=size), size))
        live_spares = [k for k in self.keys if k.startswith(SPARE_PREFIX) and k != key]
        spare_regions = self.regions.get(live_spares[-1], []) if live_spares else []
        name, size = self.rng.choice(regions + spare_regions[-1:])  # sometimes a spare's: adopted
        chunk = make_chunk(key, index=self._next_index(key), num_chunks=99, size=self.rng.randint(1, size))
        self.store.put_region(chunk.meta, name, 0, owner=_owner(key), final=self.rng.random() < 0.3)

    def register(self) -> None:
        key = self._key(new_probability=0.0)
        chain = [f"{key}/{i}".encode() for i in range(self.rng.randint(1, 3))]
        self.store.register(chain, key, num_tokens=4 * len(chain))

    def hit(self) -> None:
        key = self._key(new_probability=0.0)
        self.store.match_prefix([f"{key}/0".encode()])

    def release(self) -> None:
        if self.rng.random() < 0.05:
            self.store.release(owner=self.rng.choice(OWNERS))
        else:
            self.store.release(self._key(new_probability=0.0))

    def expire(self) -> None:
        self.clock.advance(self.rng.uniform(0.0, 3.0))
        self.store.expire()

    def seal(self) -> None:
        key = self._key(new_probability=0.0)
        self.store.seal(key, owner=_owner(key))


def test_running_byte_counts_equal_counts_from_scratch(tmp_path: Path) -> None:
    totals: Counter[str] = Counter()
    for seed in range(NUM_SEEDS):
        clock = FakeClock()
        # small tiers and budget, so the tiers spill and drop keys and the budget evicts retained ones
        store = StateStore(
            MemoryTier(15_000 if seed % 2 else 30_000),
            DiskTier(tmp_path / f"disk-{seed}", 20_000) if seed % 2 else None,
            clock=clock,
            default_lease_s=5.0,
            arena=Arena(tmp_path / "arena", pool_bytes=20_000),
            prefix_budget_bytes=10_000 + 5_000 * seed,
        )
        workload = _RandomWorkload(store, clock, seed)
        try:
            for step in range(NUM_STEPS):
                workload.step()
                _check_counts(store, f"seed {seed}, step {step}")
            totals.update({name: n for name, n in vars(store.stats()).items() if isinstance(n, int)})
        finally:
            store.close()
    # the runs exercised what they are meant to: retained keys evicted, expiries, releases, spills
    for counter in ("num_prefix_evictions", "num_evictions", "num_expiries", "num_releases", "num_spills"):
        assert totals[counter] > 0, (counter, totals)


def test_a_key_registered_before_it_is_sealed_is_counted_as_it_grows(clock: FakeClock) -> None:
    store = StateStore(MemoryTier(1 << 20), clock=clock, prefix_budget_bytes=5000)
    try:
        store.put(make_chunk("early", index=0, num_chunks=3, size=2000), owner="w")
        store.register([b"e"], "early", num_tokens=4)
        assert store.stats().num_prefix_bytes == 2000
        store.put(make_chunk("early", index=1, num_chunks=3, size=2000), owner="w")
        assert store.stats().num_prefix_bytes == 4000
        store.put(make_chunk("early", index=2, num_chunks=3, size=2000), owner="w", final=True)
        assert store.stats().num_prefix_bytes == 6000  # over budget, but only a register evicts
        store.put(make_chunk("late", size=100), owner="w", final=True)
        store.register([b"l"], "late", num_tokens=4)  # 6100 > 5000: the least recently hit goes
        assert store.lookup("early") is None
        assert (store.stats().num_prefix_bytes, store.stats().num_prefix_keys) == (100, 1)
    finally:
        store.close()


def test_over_budget_names_the_oldest_keys_until_the_rest_fit() -> None:
    retained = RetainedPrefixes(budget_bytes=250)
    for key, num_bytes in (("a", 100), ("b", 100), ("c", 100)):
        retained.add(key, num_bytes)
    assert retained.num_bytes == 300 and retained.over_budget() == ["a"]
    retained.touch("a")
    retained.resize("c", 200)  # grew after it was kept
    assert retained.num_bytes == 400 and retained.over_budget() == ["b", "c"]
    retained.discard("c")
    retained.resize("c", 999)  # a late report about a key no longer kept changes nothing
    assert retained.num_bytes == 200 and "c" not in retained and retained.over_budget() == []
