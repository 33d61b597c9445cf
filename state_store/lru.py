"""The LRU-with-pins bookkeeping both tiers share: which ids, how big, which to evict next."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from splitserve.state.errors import TierFullError


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

    def __contains__(self, oid: Hashable) -> bool:
        return oid in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def ids(self) -> list[Hashable]:
        return list(self._sizes)

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
        self.num_bytes += size - self._sizes.get(oid, 0)
        self._sizes[oid] = size
        self._sizes.move_to_end(oid)

    def touch(self, oid: Hashable) -> None:
        self._sizes.move_to_end(oid)

    def discard(self, oid: Hashable) -> int:
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
