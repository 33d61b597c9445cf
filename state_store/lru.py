"""The LRU-with-pins bookkeeping both tiers share: which ids, how big, which to evict next
(`LruIndex`, with `UnpinnedOrder` keeping its eviction order), and the tier methods answered from
it alone (`LruTier`)."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping

from splitserve.state.errors import TierFullError
from splitserve.state.records import TierStats
from state_store.tier import Tier

COMPACT_SLACK = 64  # stale heap entries tolerated beyond the live ones before a rebuild


class UnpinnedOrder:
    """The unpinned objects of a tier, oldest first by their recency stamp (a counter value
    given at each add or touch); not thread-safe.

    Pinned objects are kept out, so finding victims costs what it evicts, not what is pinned.
    Objects added or touched are the newest: they go to the end of an ordered dict. An object
    unpinned after newer ones goes back to its own place: onto a heap of such returns, merged
    with the dict by stamp when walking. Heap entries of objects touched, pinned or removed since
    are stale and dropped lazily (the heap is rebuilt once they outnumber the live ones); each
    entry has its own number, as an object pinned and unpinned again comes back with its stamp.
    """

    def __init__(self) -> None:
        self._recent: OrderedDict[Hashable, int] = OrderedDict()  # stamps increase front to back
        self._returned: dict[Hashable, tuple[int, int]] = {}  # the live heap entries: id -> (stamp, number)
        self._heap: list[tuple[int, int, Hashable]] = []  # (stamp, number, id): the numbers are unique
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._recent) + len(self._returned)

    def clear(self) -> None:
        self._recent.clear()
        self._returned.clear()
        self._heap.clear()

    def add_newest(self, oid: Hashable, stamp: int) -> None:
        """`oid` (new or present) becomes the newest; `stamp` exceeds every stamp given before."""
        self.remove(oid)
        self._recent[oid] = stamp

    def put_back(self, oid: Hashable, stamp: int) -> None:
        """`oid` (absent: it was pinned) returns at its place by `stamp` among the others."""
        if not self._recent or stamp > next(reversed(self._recent.values())):
            self._recent[oid] = stamp
            return
        number = next(self._numbers)
        self._returned[oid] = (stamp, number)
        heapq.heappush(self._heap, (stamp, number, oid))

    def remove(self, oid: Hashable) -> None:
        self._recent.pop(oid, None)
        if (
            self._returned.pop(oid, None) is not None
            and len(self._heap) > 2 * len(self._returned) + COMPACT_SLACK
        ):
            self._heap = [(stamp, number, other) for other, (stamp, number) in self._returned.items()]
            heapq.heapify(self._heap)

    def oldest(
        self, num_bytes: int, sizes: Mapping[Hashable, int], skip: Hashable
    ) -> tuple[list[Hashable], int]:
        """The oldest objects but `skip`, in order, until their `sizes` add up to `num_bytes`
        (all of them if they never do), and what they add up to. Changes nothing but dropping the
        stale heap entries it meets."""
        chosen: list[Hashable] = []
        total_bytes = 0
        recent = iter(self._recent.items())
        next_recent = next(recent, None)
        heap, popped = self._heap, []
        try:
            while total_bytes < num_bytes:
                while heap and self._returned.get(heap[0][2]) != heap[0][:2]:
                    heapq.heappop(heap)  # stale: that object was touched, pinned or removed
                if heap and (next_recent is None or heap[0][0] < next_recent[1]):
                    entry = heapq.heappop(heap)
                    popped.append(entry)
                    candidate = entry[2]
                elif next_recent is not None:
                    candidate, next_recent = next_recent[0], next(recent, None)
                else:
                    break
                if candidate != skip:
                    chosen.append(candidate)
                    total_bytes += sizes[candidate]
        finally:
            for entry in popped:  # the walk only looked: every live entry goes back
                heapq.heappush(heap, entry)
        return chosen, total_bytes


class LruIndex:
    """Sizes, recency and pin counts of a tier's objects; not thread-safe (the tier locks).

    Owns no bytes: it only decides. `victims(size)` names the least recently used unpinned ids
    whose removal makes room for `size` more bytes, or raises `TierFullError` if none would; it
    costs O(victims) (amortised, times log n for objects unpinned after newer ones came), however
    many objects are pinned. An object's recency is its last `add` or `touch`, pinned or not: one
    unpinned returns to where that puts it among the others.
    """

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name} tier capacity must be >= 0 bytes (got {capacity_bytes})")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._sizes: dict[Hashable, int] = {}
        self._stamps: dict[Hashable, int] = {}  # each object's last add or touch
        self._clock = itertools.count()
        self._unpinned = UnpinnedOrder()
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
        self._stamps.clear()
        self._unpinned.clear()
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
        chosen, freed = self._unpinned.oldest(size - free, self._sizes, skip=oid)
        free += freed
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
        self.touch(oid)

    def touch(self, oid: Hashable) -> None:
        if oid not in self._sizes:
            raise KeyError(oid)
        stamp = self._stamps[oid] = next(self._clock)
        if oid not in self._pins:
            self._unpinned.add_newest(oid, stamp)

    def discard(self, oid: Hashable) -> int:
        if oid in self._sizes:
            key = _key_of(oid)
            remaining = self._num_objects_per_key.pop(key) - 1
            if remaining:
                self._num_objects_per_key[key] = remaining
            self._unpinned.remove(oid)
            del self._stamps[oid]
        size = self._sizes.pop(oid, 0)
        self._pins.pop(oid, None)
        self.num_bytes -= size
        return size

    def pin(self, oid: Hashable) -> bool:
        if oid not in self._sizes:
            return False
        count = self._pins.get(oid, 0)
        if count == 0:
            self._unpinned.remove(oid)
        self._pins[oid] = count + 1
        return True

    def unpin(self, oid: Hashable) -> bool:
        count = self._pins.get(oid, 0)
        if count == 0:
            return False
        if count == 1:
            del self._pins[oid]
            self._unpinned.put_back(oid, self._stamps[oid])
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
