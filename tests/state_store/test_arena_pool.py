"""`RegionPool` (freed regions bisected by size) against the rule the arena had: a list of freed
regions scanned for the smallest of n to 2n bytes, the earliest freed among equal sizes, kept
while the pool's byte cap allows. Seeded random mixes of frees and allocations must hand out
the same regions and keep the same bytes."""

from __future__ import annotations

import random

import pytest

from state_store.arena import Region
from state_store.arena_pool import RegionPool


class ReferencePool:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.regions: list[Region] = []

    def add(self, region: Region) -> bool:
        if (
            not region.num_bytes
            or sum(r.num_bytes for r in self.regions) + region.num_bytes > self.capacity_bytes
        ):
            return False
        self.regions.append(region)
        return True

    def take(self, num_bytes: int) -> Region | None:
        fits = [r for r in self.regions if num_bytes <= r.num_bytes <= 2 * num_bytes]
        if not fits:
            return None
        region = min(fits, key=lambda r: r.num_bytes)
        self.regions.remove(region)
        return region


@pytest.mark.parametrize("seed", range(10))
def test_random_frees_and_allocations_get_the_reference_rules_regions(seed: int) -> None:
    rng = random.Random(seed)
    capacity_bytes = rng.choice([0, 500, 5_000, 1 << 40])
    pool, reference = RegionPool(capacity_bytes), ReferencePool(capacity_bytes)
    held: list[Region] = []  # allocated, to be freed again: a region comes back with its own size
    for step in range(2000):
        if held and rng.random() < 0.5:
            region = held.pop(rng.randrange(len(held)))
            assert pool.add(region) == reference.add(region), f"seed {seed} step {step}"
        elif rng.random() < 0.5:  # a fresh region (the arena would create its file)
            region = _region(f"r{step}", rng.choice([0, 1, 2, 3, 50, 64, 100, 128, 400, 1000]))
            assert pool.add(region) == reference.add(region)
        else:
            wanted = rng.choice([0, 1, 2, 3, 30, 50, 64, 90, 200, 500, 900])
            taken = pool.take(wanted)
            assert taken is reference.take(wanted), f"seed {seed} step {step}: wanted {wanted}"
            if taken is not None:
                held.append(taken)
        assert pool.num_bytes == sum(r.num_bytes for r in reference.regions)
        assert len(pool) == len(reference.regions)


def _region(name: str, num_bytes: int) -> Region:
    return Region(name, num_bytes, memoryview(b""))


def test_the_smallest_fit_wins_equal_sizes_go_in_the_order_freed_and_the_cap_holds() -> None:
    first, second, bigger, biggest = _region("a", 96), _region("b", 96), _region("c", 100), _region("d", 200)
    pool = RegionPool(1 << 20)
    for region in (biggest, bigger, second, first):
        assert pool.add(region)
    assert pool.take(99) is bigger  # 96 is too small; 100 is the smallest of 99..198
    assert pool.take(90) is second  # freed before `first`
    assert pool.take(90) is first
    assert pool.take(90) is None  # 200 is over twice 90
    assert pool.take(100) is biggest and pool.num_bytes == 0
    capped = RegionPool(150)
    assert capped.add(first) and not capped.add(second) and not capped.add(_region("empty", 0))
    assert capped.num_bytes == 96 and len(capped) == 1
