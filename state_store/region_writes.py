"""The arena half of the store's writes: regions allocated to keys, chunks committed in them.

A mixin of `StateStore` (state_store/store.py), kept apart so each file holds one concept; it
uses the store's lock, entries and tiers under the store's rules (the *_locked helpers).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from splitserve.state.chunk import ChunkId, ChunkMeta, can_cut
from splitserve.state.errors import (
    InvalidChunkError,
    KeySealedError,
    StateReleasedError,
    StateStoreError,
    StoreFullError,
)
from splitserve.state.shm import SPARE_PREFIX
from state_store.tiered import RegionId

if TYPE_CHECKING:
    from state_store.arena import Arena, Region
    from state_store.entry import Entry
    from state_store.tiered import TieredStorage


def is_spare_key(key: str) -> bool:
    """Whether `key` names a writer's spare region (`StateStoreClient(spare_region=True)`)."""
    return key.startswith(SPARE_PREFIX)


class RegionWrites:
    """`allocate` and `put_region`: a writer on the node fills an arena region, then commits the
    chunks in it; no byte passes through the store.

    A writer may lease a region ahead under a spare key (`SPARE_PREFIX`, its own lease, owned by
    the writer): its first commit naming that region under another key of the same owner moves
    the region to that key (`_adopt_spare_locked`), so the `Allocate` round trip is off the
    transfer's path. A spare never used is freed when its lease runs out, or with its owner.
    """

    if TYPE_CHECKING:
        arena: Arena | None
        max_chunk_bytes: int
        _lock: threading.Lock
        _closed: bool
        _tiers: TieredStorage
        _entries: dict[str, Entry]
        _spare_regions: dict[str, str]

        def _expire_locked(self) -> int: ...
        def _writable_locked(self, key: str, owner: str, lease_s: float | None) -> Entry: ...
        def _evict_locked(self, key: str, why: str) -> None: ...
        def _tier_put_locked(
            self, key: str, oid: ChunkId | RegionId, data: bytes | memoryview, **kwargs: bool
        ) -> list[tuple[str, str]]: ...
        def _notify_locked(self, key: str) -> None: ...
        def _drop_locked(self, entry: Entry, cls: type[StateStoreError], why: str) -> int: ...

    def allocate(self, key: str, *, owner: str, num_bytes: int, lease_s: float | None = None) -> str:
        """A new arena region of `num_bytes` for `key` (created, owned by `owner`, if new); its name.

        Raises `StoreFullError` if the memory tier cannot hold it beside what is pinned, and
        `InvalidChunkError` if this store has no arena.
        """
        if self.arena is None:
            raise InvalidChunkError("this state store has no shared-memory arena; put the bytes instead")
        region = self.arena.allocate(num_bytes)  # outside the lock: reserving pages takes a while
        try:
            with self._lock:
                if self._closed:
                    raise StateReleasedError("the state store is closed")
                self._expire_locked()
                entry = self._writable_locked(key, owner, lease_s)
                try:
                    lost = self._tier_put_locked(
                        key, RegionId(key, region.name), region.view, pin=True, memory_only=True
                    )
                except StoreFullError as e:
                    raise StoreFullError(
                        f"cannot hold a {num_bytes}-byte region of key {key!r}: {e}"
                    ) from None
                entry.add_region(region)
                if is_spare_key(key):
                    self._spare_regions[region.name] = key
                for lost_key, why in lost:
                    self._evict_locked(lost_key, why)
        except BaseException:
            self.arena.free(region)
            raise
        return region.name

    def put_region(
        self,
        meta: ChunkMeta,
        region: str,
        offset: int,
        *,
        owner: str,
        lease_s: float | None = None,
        final: bool = False,
    ) -> None:
        """Commits a chunk whose bytes the writer put in `region` (of its key) at `offset`.

        Like `put`, but no byte moves and none is checked here: the reader verifies the checksum
        before it uses a byte (one pass per hop). A region's chunk may be a whole piece of any
        size if it can be cut for a reader of bytes (`can_cut`; the servicer cuts it).
        """
        if meta.num_bytes > self.max_chunk_bytes and not can_cut(meta):
            raise InvalidChunkError(
                f"{meta.describe()} is {meta.num_bytes} bytes, over the store's {self.max_chunk_bytes}, "
                "and neither its object's only chunk nor MLA rows numbered by token; commit a region's "
                "piece as one chunk"
            )
        with self._lock:
            if self._closed:
                raise StateReleasedError("the state store is closed")
            self._expire_locked()
            entry = self._writable_locked(meta.key, owner, lease_s)
            place = entry.regions.get(region) or self._adopt_spare_locked(entry, region, owner)
            if place is None:
                raise InvalidChunkError(f"{meta.describe()} names region {region!r}, not one of its key's")
            if offset < 0 or offset + meta.num_bytes > place.num_bytes:
                raise InvalidChunkError(
                    f"{meta.describe()} at offset {offset} overruns region {region!r} of {place.num_bytes} bytes"
                )
            if meta.id in entry.metas:
                raise KeySealedError(f"{meta.describe()} was already stored; chunks are written once")
            entry.add(meta, (place, offset))
            entry.sealed = final
            entry.cond.notify_all()
            self._notify_locked(meta.key)

    def _adopt_spare_locked(self, entry: Entry, name: str, owner: str) -> Region | None:
        """Moves region `name` from its spare key, if `owner` holds it there, to `entry`'s key
        (counted, pinned, freed with it from now on); the emptied spare key is dropped. None if
        no spare of `owner` holds it (a wrong name, or a spare whose lease ran out)."""
        spare_key = self._spare_regions.get(name)
        spare = self._entries.get(spare_key) if spare_key is not None else None
        if spare is None or spare.owner != owner or name not in spare.regions or spare is entry:
            return None
        region = spare.pop_region(name)
        del self._spare_regions[name]
        self._tiers.remove(RegionId(spare.key, name))
        # the bytes just left the tier, so this put fits without evicting anything
        self._tier_put_locked(entry.key, RegionId(entry.key, name), region.view, pin=True, memory_only=True)
        entry.add_region(region)
        self._drop_locked(
            spare, StateReleasedError, f"spare key {spare.key!r} gave its region to {entry.key!r}"
        )
        return region
