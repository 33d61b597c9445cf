"""The store's retained prefixes: registered keys kept without a lease, least recently hit first out."""

from __future__ import annotations

from collections import OrderedDict


class RetainedPrefixes:
    """Which keys the store keeps because its prefix index advertises them, in LRU order, what
    they hold in all, and which of them to drop when they hold more than `budget_bytes` (None:
    no budget of their own; the tiers still evict them like any key).

    Owns no bytes and no lease: the store asks `over_budget` which keys to drop and drops them
    itself (which forgets them in the index). Each key's size is given on `add` and kept current
    with `resize` (a key registered before it was sealed still grows), so `num_bytes` is a
    running total: reading it costs O(1) and `over_budget` O(victims), however many keys are
    kept. Not thread-safe (the store locks).
    """

    def __init__(self, budget_bytes: int | None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"the retained-prefix budget must be >= 0 bytes (got {budget_bytes})")
        self.budget_bytes = budget_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._num_bytes = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    @property
    def num_bytes(self) -> int:
        """What the kept keys hold in all (the sum of their last `add`/`resize` sizes)."""
        return self._num_bytes

    def size_of(self, key: str) -> int:
        return self._sizes[key]

    def keys(self) -> list[str]:
        """The kept keys, least recently used first (a copy: O(keys), not for hot paths)."""
        return list(self._sizes)

    def add(self, key: str, num_bytes: int) -> None:
        """Keeps `key`, holding `num_bytes` (most recently used)."""
        self._sizes.setdefault(key, 0)
        self.resize(key, num_bytes)
        self._sizes.move_to_end(key)

    def resize(self, key: str, num_bytes: int) -> None:
        """A kept `key` now holds `num_bytes` (it grew after it was registered, or shrank); a key
        not kept (any more) is ignored, so a late report about a dropped key changes nothing."""
        if num_bytes < 0:
            raise ValueError(f"retained key {key!r} cannot hold {num_bytes} bytes (< 0)")
        old_bytes = self._sizes.get(key)
        if old_bytes is not None:
            self._num_bytes += num_bytes - old_bytes
            self._sizes[key] = num_bytes

    def touch(self, key: str) -> None:
        """`key` was just hit: it goes last in line for eviction."""
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def oldest(self, excluding: str) -> str | None:
        """The least recently used key other than `excluding`, or None."""
        return next((key for key in self._sizes if key != excluding), None)

    def discard(self, key: str) -> None:
        self._num_bytes -= self._sizes.pop(key, 0)

    def over_budget(self) -> list[str]:
        """The least recently used keys to drop so the rest fit the budget (oldest first)."""
        if self.budget_bytes is None:
            return []
        excess = self._num_bytes - self.budget_bytes
        victims = []
        for key, num_bytes in self._sizes.items():
            if excess <= 0:
                break
            victims.append(key)
            excess -= num_bytes
        return victims
