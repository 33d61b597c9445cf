"""The interface every storage tier implements (host RAM, local disk, ...), siblings behind it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import NamedTuple

from splitserve.state.records import TierStats


class Evicted(NamedTuple):
    """An object a tier pushed out to make room: its id, and its bytes if the tier still had them
    in hand (RAM hands them over so the store can spill them; disk has already deleted them)."""

    oid: Hashable
    data: bytes | memoryview | None


class Tier(ABC):
    """A bounded map from object id to bytes, with least-recently-used eviction and pins.

    Contract, for every implementation:

    * Ownership: the tier owns the bytes it was given and the resources holding them (RAM,
      files); `remove` and `close` free them. It knows nothing of keys, leases or checksums: the
      store keeps the metadata and verifies every read.
    * Capacity: `num_bytes <= capacity_bytes` always. `put` makes room by evicting unpinned
      objects, least recently used (`put` or `get`) first, and returns what it evicted. If room
      cannot be made (the object is larger than the capacity, or the rest is pinned) it raises
      `TierFullError` and changes nothing.
    * Pins: a pinned object is never evicted. Pins count: n `pin`s need n `unpin`s. `remove`
      removes a pinned object too (the owner's explicit release beats the pin).
    * Locking: every method is atomic and safe to call from any thread (one lock per tier).
      Callers may hold their own lock around calls; a tier never calls back into its caller.
    * `put` of an id already present replaces it (pins are kept).
    """

    name: str

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @abstractmethod
    def contains(self, oid: Hashable) -> bool: ...

    @abstractmethod
    def put(self, oid: Hashable, data: bytes | memoryview) -> list[Evicted]:
        """Stores `data` under `oid`; returns the objects evicted to make room."""

    @abstractmethod
    def get(self, oid: Hashable) -> bytes | memoryview | None:
        """The bytes under `oid` (and marks it recently used), or None if the tier lacks it."""

    @abstractmethod
    def pin(self, oid: Hashable) -> bool:
        """Protects `oid` from eviction; False if the tier lacks it."""

    @abstractmethod
    def unpin(self, oid: Hashable) -> bool:
        """Drops one pin of `oid`; False if the tier lacks it or it was not pinned."""

    @abstractmethod
    def remove(self, oid: Hashable) -> int:
        """Frees `oid`; returns the bytes freed (0 if the tier lacked it)."""

    @abstractmethod
    def stats(self) -> TierStats: ...

    @abstractmethod
    def close(self) -> None:
        """Frees everything; the tier must not be used afterwards."""
