"""Host-RAM tier: bytes objects in a dict, bounded in bytes, least recently used evicted first."""

from __future__ import annotations

import threading
from collections.abc import Hashable

from splitserve.state.records import TierStats
from state_store.lru import LruIndex
from state_store.tier import Evicted, Tier


class MemoryTier(Tier):
    """Holds objects in host RAM up to `capacity_bytes`.

    Owns the `bytes` objects it was given (no copies: they are immutable). Evictions hand the
    bytes back in `Evicted.data` so the store can spill them to the next tier. See `Tier` for the
    locking, eviction and pin contract.
    """

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        self._lock = threading.Lock()
        self._index = LruIndex(self.name, capacity_bytes)
        self._objects: dict[Hashable, bytes] = {}

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    def contains(self, oid: Hashable) -> bool:
        with self._lock:
            return oid in self._index

    def put(self, oid: Hashable, data: bytes) -> list[Evicted]:
        data = bytes(data)
        with self._lock:
            victims = self._index.victims(oid, len(data))
            evicted = [Evicted(v, self._objects.pop(v)) for v in victims]
            for victim in victims:
                self._index.discard(victim)
            self._objects[oid] = data
            self._index.add(oid, len(data))
            return evicted

    def get(self, oid: Hashable) -> bytes | None:
        with self._lock:
            data = self._objects.get(oid)
            if data is not None:
                self._index.touch(oid)
            return data

    def pin(self, oid: Hashable) -> bool:
        with self._lock:
            return self._index.pin(oid)

    def unpin(self, oid: Hashable) -> bool:
        with self._lock:
            return self._index.unpin(oid)

    def remove(self, oid: Hashable) -> int:
        with self._lock:
            self._objects.pop(oid, None)
            return self._index.discard(oid)

    def stats(self) -> TierStats:
        with self._lock:
            index = self._index
            return TierStats(self.name, index.num_bytes, index.capacity_bytes, len(index), index.num_pinned)

    def close(self) -> None:
        with self._lock:
            for oid in self._index.ids():
                self._index.discard(oid)
            self._objects.clear()
