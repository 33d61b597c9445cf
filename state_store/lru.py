"""The LRU-with-pins bookkeeping both tiers share: which ids, how big, which to evict next
(`LruIndex`), and the tier methods answered from it alone (`LruTier`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

from splitserve.state.errors import TierFullError
from splitserve.state.records import TierStats
from state_store.tier import Tier


class LruIndex:
    """Sizes, recency and pin counts of a tier's objects; not thread-safe (the tier locks).

    Owns no bytes: it only decides. `victims(size)` names the least recently used unpinned ids
    whose removal makes room for `size` more bytes, or raises `TierFullError` if none would.
    """

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name} tier capacity must be >= 0 bytes (got {capacity_bytes})")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()
        self._pins: dict[Hashable, int] = {}
        self._num_objects_per_key: dict[Hashable, int] = {}  # a chunk id's key, else the id itself

    def __contains__(self, oid: Hashable) -> bool:
        return oid in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    @property
    def num_keys(self) -> int:
        """Distinct state keys with at least one object here."""
        return len(self._num_objects_per_key)

    def clear(self) -> None:
        self._sizes.clear()
        self._pins.clear()
        self._num_objects_per_key.clear()
        self.num_bytes = 0

    def victims(self, oid: Hashable, size: int) -> list[Hashable]:
        """Ids to evict (oldest first) so `oid` of `size` bytes fits; `oid` itself never counts."""
        free = self.capacity_bytes - self.num_bytes + self._sizes.get(oid, 0)
        if size > self.capacity_bytes:
            raise TierFullError(
                f"{size} bytes exceed the {self.name} tier's capacity of {self.capacity_bytes}"
            )
        chosen: list[Hashable] = []
        for candidate, candidate_size in self._sizes.items():
            if free >= size:
                break
            if candidate == oid or candidate in self._pins:
                continue
            chosen.append(candidate)
            free += candidate_size
        if free < size:
            raise TierFullError(
                f"{self.name} tier cannot fit {size} bytes: {self.capacity_bytes - free} of "
                f"{self.capacity_bytes} bytes are pinned or in use"
            )
        return chosen

    def add(self, oid: Hashable, size: int) -> None:
        if oid not in self._sizes:
            key = _key_of(oid)
            self._num_objects_per_key[key] = self._num_objects_per_key.get(key, 0) + 1
        self.num_bytes += size - self._sizes.get(oid, 0)
        self._sizes[oid] = size
        self._sizes.move_to_end(oid)

    def touch(self, oid: Hashable) -> None:
        self._sizes.move_to_end(oid)

    def discard(self, oid: Hashable) -> int:
        if oid in self._sizes:
            key = _key_of(oid)
            remaining = self._num_objects_per_key.pop(key) - 1
            if remaining:
                self._num_objects_per_key[key] = remaining
        size = self._sizes.pop(oid, 0)
        self._pins.pop(oid, None)
        self.num_bytes -= size
        return size

    def pin(self, oid: Hashable) -> bool:
        if oid not in self._sizes:
            return False
        self._pins[oid] = self._pins.get(oid, 0) + 1
        return True

    def unpin(self, oid: Hashable) -> bool:
        count = self._pins.get(oid, 0)
        if count == 0:
            return False
        if count == 1:
            del self._pins[oid]
        else:
            self._pins[oid] = count - 1
        return True


class LruTier(Tier):
    """A tier whose eviction order, sizes and pins live in one `LruIndex` under one lock.

    Answers `capacity_bytes`, `contains`, `pin`, `unpin` and `stats` from the index; subclasses
    hold the bytes (`put`, `get`, `remove`, `close`) and take `self._lock` around every use of
    `self._index`.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self._lock = threading.Lock()
        self._index = LruIndex(self.name, capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    def contains(self, oid: Hashable) -> bool:
        with self._lock:
            return oid in self._index

    def pin(self, oid: Hashable) -> bool:
        with self._lock:
            return self._index.pin(oid)

    def unpin(self, oid: Hashable) -> bool:
        with self._lock:
            return self._index.unpin(oid)

    def stats(self) -> TierStats:
        with self._lock:
            index = self._index
            return TierStats(
                self.name, index.num_bytes, index.capacity_bytes, len(index), index.num_pinned, index.num_keys
            )


def _key_of(oid: Hashable) -> Hashable:
    """The state key an object belongs to (a `ChunkId`'s key); any other id counts as its own key."""
    return getattr(oid, "key", oid)
