"""Host-RAM tier: bytes objects in a dict, bounded in bytes, least recently used evicted first."""

from __future__ import annotations

from collections.abc import Hashable

from state_store.lru import LruTier
from state_store.tier import Evicted


class MemoryTier(LruTier):
    """Holds objects in host RAM up to `capacity_bytes`.

    Owns the `bytes` objects it was given (no copies: they are immutable), and counts the store's
    shared-memory regions (memoryviews of them, pinned while their key lives) against its room. Evictions hand the
    bytes back in `Evicted.data` so the store can spill them to the next tier. See `Tier` for the
    locking, eviction and pin contract.
    """

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._objects: dict[Hashable, bytes | memoryview] = {}

    def put(self, oid: Hashable, data: bytes | memoryview) -> list[Evicted]:
        if not isinstance(data, (bytes, memoryview)):  # a store's arena region comes as a memoryview
            data = bytes(data)
        with self._lock:
            victims = self._index.victims(oid, len(data))
            evicted = [Evicted(v, self._objects.pop(v)) for v in victims]
            for victim in victims:
                self._index.discard(victim)
            self._objects[oid] = data
            self._index.add(oid, len(data))
            return evicted

    def get(self, oid: Hashable) -> bytes | memoryview | None:
        with self._lock:
            data = self._objects.get(oid)
            if data is not None:
                self._index.touch(oid)
            return data

    def remove(self, oid: Hashable) -> int:
        with self._lock:
            self._objects.pop(oid, None)
            return self._index.discard(oid)

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._objects.clear()
