"""The store's retained prefixes: registered keys kept without a lease, least recently hit first out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class RetainedPrefixes:
    """Which keys the store keeps because its prefix index advertises them, in LRU order, and
    which of them to drop when they hold more than `budget_bytes` (None: no budget of their own;
    the tiers still evict them like any key).

    Owns no bytes and no lease: the store asks `over_budget` which keys to drop and drops them
    itself (which forgets them in the index). Sizes are read through `size_of` when asked, so a
    key registered before it was sealed is counted at its final size. Not thread-safe (the store
    locks).
    """

    def __init__(self, budget_bytes: int | None, size_of: Callable[[str], int]) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"the retained-prefix budget must be >= 0 bytes (got {budget_bytes})")
        self.budget_bytes = budget_bytes
        self._size_of = size_of
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    @property
    def num_bytes(self) -> int:
        return sum(self._size_of(key) for key in self._keys)

    def add(self, key: str) -> None:
        """Keeps `key` (most recently used)."""
        self._keys[key] = None
        self._keys.move_to_end(key)

    def touch(self, key: str) -> None:
        """`key` was just hit: it goes last in line for eviction."""
        if key in self._keys:
            self._keys.move_to_end(key)

    def oldest(self, excluding: str) -> str | None:
        """The least recently used key other than `excluding`, or None."""
        return next((key for key in self._keys if key != excluding), None)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def over_budget(self) -> list[str]:
        """The least recently used keys to drop so the rest fit the budget (oldest first)."""
        if self.budget_bytes is None:
            return []
        excess = self.num_bytes - self.budget_bytes
        victims = []
        for key in self._keys:
            if excess <= 0:
                break
            victims.append(key)
            excess -= self._size_of(key)
        return victims
