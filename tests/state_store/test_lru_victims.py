"""`LruIndex` (pinned objects kept out of its eviction order) against the plain rule it replaced:
one list in recency order, walked from the oldest, skipping pinned objects and the object being
put. Seeded random mixes of adds, touches, pins, unpins, discards and victim queries must give
the same victims, the same errors and the same counts."""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest

from splitserve.state.chunk import ChunkId, StateKind
from splitserve.state.errors import TierFullError
from state_store import lru
from state_store.lru import COMPACT_SLACK, LruIndex


class ReferenceIndex:
    """The rule as the tiers had it: the whole recency order scanned on every query."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.order: list[Hashable] = []  # oldest first
        self.sizes: dict[Hashable, int] = {}
        self.pins: dict[Hashable, int] = {}

    def victims(self, oid: Hashable, size: int) -> list[Hashable]:
        free = self.capacity_bytes - sum(self.sizes.values()) + self.sizes.get(oid, 0)
        if size > self.capacity_bytes:
            raise TierFullError(f"{size} bytes exceed the test tier's capacity of {self.capacity_bytes}")
        chosen = []
        for candidate in self.order:
            if free >= size:
                break
            if candidate != oid and not self.pins.get(candidate):
                chosen.append(candidate)
                free += self.sizes[candidate]
        if free < size:
            raise TierFullError(
                f"test tier cannot fit {size} bytes: {self.capacity_bytes - free} of "
                f"{self.capacity_bytes} bytes are pinned or in use"
            )
        return chosen

    def add(self, oid: Hashable, size: int) -> None:
        self.sizes[oid] = size
        self.touch(oid)

    def touch(self, oid: Hashable) -> None:
        if oid in self.order:
            self.order.remove(oid)
        self.order.append(oid)

    def discard(self, oid: Hashable) -> int:
        if oid in self.order:
            self.order.remove(oid)
        self.pins.pop(oid, None)
        return self.sizes.pop(oid, 0)

    def pin(self, oid: Hashable) -> bool:
        if oid not in self.sizes:
            return False
        self.pins[oid] = self.pins.get(oid, 0) + 1
        return True

    def unpin(self, oid: Hashable) -> bool:
        if not self.pins.get(oid):
            return False
        self.pins[oid] -= 1
        if not self.pins[oid]:
            del self.pins[oid]
        return True


def _outcome(query, *args):
    try:
        return query(*args)
    except TierFullError as e:
        return ("TierFullError", str(e))


@pytest.mark.parametrize("compact_slack", [COMPACT_SLACK, 0])  # 0: the heap is rebuilt often
@pytest.mark.parametrize("seed", range(8))
def test_random_operations_give_the_reference_rules_victims_errors_and_counts(
    seed: int, compact_slack: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lru, "COMPACT_SLACK", compact_slack)
    rng = random.Random(seed)
    capacity_bytes = rng.choice([50, 400, 3000])
    index, reference = LruIndex("test", capacity_bytes), ReferenceIndex(capacity_bytes)
    ids: list[Hashable] = [
        ChunkId(f"key-{k}", 0, StateKind.KDA_RECURRENT, i) for k in range(6) for i in range(4)
    ] + list(range(16))
    for step in range(3000):
        oid, roll = rng.choice(ids), rng.random()
        if roll < 0.25:  # a put, as the tiers make it: ask for victims, evict them, add
            size = rng.randrange(0, capacity_bytes // 4 + 2)
            outcome = _outcome(index.victims, oid, size)
            assert outcome == _outcome(reference.victims, oid, size), f"seed {seed} step {step}"
            if isinstance(outcome, list):
                for victim in outcome:
                    assert index.discard(victim) == reference.discard(victim)
                index.add(oid, size)
                reference.add(oid, size)
        elif roll < 0.4:
            if oid in reference.sizes:
                index.touch(oid)
                reference.touch(oid)
        elif roll < 0.6:
            assert index.pin(oid) == reference.pin(oid)
        elif roll < 0.85:
            assert index.unpin(oid) == reference.unpin(oid)
        elif roll < 0.99:
            assert index.discard(oid) == reference.discard(oid)
        else:
            index.clear()
            reference.__init__(capacity_bytes)  # type: ignore[misc]
        size = rng.randrange(0, capacity_bytes + 2)  # a query whose answer is not acted on
        assert _outcome(index.victims, oid, size) == _outcome(reference.victims, oid, size)
        assert index.num_bytes == sum(reference.sizes.values()) and len(index) == len(reference.sizes)
        assert index.num_pinned == len(reference.pins)
        assert index.num_keys == len({getattr(o, "key", o) for o in reference.sizes})


def test_an_object_unpinned_after_newer_ones_is_evicted_at_its_own_place() -> None:
    index = LruIndex("test", 40)
    for oid in "abcd":
        index.add(oid, 10)
    index.pin("a")
    index.touch("b")  # order now a, c, d, b
    assert index.victims("e", 10) == ["c"]  # a is pinned
    index.unpin("a")  # back before c: its last touch is older
    assert index.victims("e", 30) == ["a", "c", "d"]
    index.pin("c")
    index.touch("c")  # touched while pinned: newest once unpinned
    index.unpin("c")
    assert index.victims("e", 40) == ["a", "d", "b", "c"]


def test_many_pin_cycles_keep_the_order_right_and_the_heap_bounded() -> None:
    index = LruIndex("test", 1000)
    for n in range(100):
        index.add(n, 10)
    for cycle in range(50):
        for n in range(cycle % 7, 100, 7):
            index.pin(n)
        for n in range(cycle % 7, 100, 7):
            index.unpin(n)
        index.touch(cycle)  # stale heap entries pile up as touched objects move to the end
    expected = [n for n in range(100) if n >= 50] + list(range(50))
    assert index.victims("new", 1000) == expected
    assert len(index._unpinned._heap) <= 2 * len(index._unpinned._returned) + COMPACT_SLACK
