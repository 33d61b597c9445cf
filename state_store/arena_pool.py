"""The arena's pool of freed regions, ordered by size, so reuse finds its fit in O(log n)."""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the arena imports this module
    from state_store.arena import Region


class RegionPool:
    """Freed regions kept for reuse (their pages resident), up to `capacity_bytes` in all; not
    thread-safe (the arena locks).

    `take(n)` hands out the smallest region of n to 2n bytes, the earliest freed among equal
    sizes, found by bisecting the regions' (size, order freed) keys instead of scanning them.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._keys: list[tuple[int, int]] = []  # (num_bytes, order freed), sorted
        self._regions: dict[tuple[int, int], Region] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, region: Region) -> bool:
        """Keeps `region` if it has bytes and the pool has room for them; whether it did."""
        if not region.num_bytes or self.num_bytes + region.num_bytes > self.capacity_bytes:
            return False
        key = (region.num_bytes, next(self._order))
        bisect.insort(self._keys, key)
        self._regions[key] = region
        self.num_bytes += region.num_bytes
        return True

    def take(self, num_bytes: int) -> Region | None:
        """Removes and returns the smallest region of `num_bytes` to 2 * `num_bytes` bytes, or None."""
        i = bisect.bisect_left(self._keys, (num_bytes,))  # (n,) sorts before every (n, order)
        if i == len(self._keys) or self._keys[i][0] > 2 * num_bytes:
            return None
        region = self._regions.pop(self._keys.pop(i))
        self.num_bytes -= region.num_bytes
        return region
