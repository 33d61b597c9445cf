"""The store's reads for a caller that must not block: poll for the next chunk, and be called
back (`watch`) when it may have come. The grpc.aio servicer parks each waiting Get on these.

A mixin of `StateStore` (state_store/store.py), kept apart so each file holds one concept; it
uses the store's lock and entries under the store's rules (the *_locked helpers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitserve.state.chunk import ChunkMeta
from splitserve.state.errors import StateReleasedError

if TYPE_CHECKING:
    from state_store.entry import Entry, Tombstones


class PolledReads:
    """`poll`, `read`, `location` and `watch`: a reader's steps without a waiting thread."""

    if TYPE_CHECKING:
        _lock: threading.Lock
        _closed: bool
        _entries: dict[str, Entry]
        _tombstones: Tombstones
        _watchers: dict[str, set[Callable[[], object]]]

        def _expire_locked(self) -> int: ...
        def _live_locked(self, key: str) -> Entry: ...
        def _read(self, entry: Entry, meta: ChunkMeta) -> bytes | memoryview: ...

    def poll(self, key: str, position: int, *, wait_for_key: bool = False) -> ChunkMeta | None | bool:
        """Without waiting: chunk number `position` of `key` if it is there, True if the key is
        sealed with fewer chunks (the read is done), None if it may still come (wait for a
        `watch` callback and poll again). Raises what `get` raises."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(key)
            if entry is None and wait_for_key:
                self._tombstones.raise_if_gone(key)
                if self._closed:
                    raise StateReleasedError(f"key {key!r} will never arrive: the store closed")
                return None
            entry = entry if entry is not None else self._live_locked(key)
            if position < len(entry.order):
                return entry.metas[entry.order[position]]
            return True if entry.sealed else None

    def read(self, meta: ChunkMeta) -> bytes | memoryview:
        """The checksum-verified bytes of a chunk `poll` returned (a region's are a view)."""
        with self._lock:
            entry = self._live_locked(meta.key)
        return self._read(entry, meta)

    def location(self, meta: ChunkMeta) -> tuple[str, int] | None:
        """(region name, offset) of a chunk committed in the arena, None if it was put as bytes."""
        with self._lock:
            entry = self._live_locked(meta.key)
            place = entry.locations.get(meta.id)
            return None if place is None else (place[0].name, place[1])

    @property
    def num_watched_keys(self) -> int:
        """Keys some `watch` callback waits on (a gauge of outstanding async reads)."""
        with self._lock:
            return len(self._watchers)

    def watch(self, key: str, callback: Callable[[], object]) -> Callable[[], None]:
        """Calls `callback` (under the store's lock: it must only schedule work) whenever `key`
        may have changed: a chunk, its seal, its end, or the store closing. Returns the unwatch."""
        with self._lock:
            self._watchers.setdefault(key, set()).add(callback)

        def unwatch() -> None:
            with self._lock:
                callbacks = self._watchers.get(key)
                if callbacks is not None:
                    callbacks.discard(callback)
                    if not callbacks:
                        del self._watchers[key]

        return unwatch

    def _notify_locked(self, key: str) -> None:
        for callback in list(self._watchers.get(key, ())):
            callback()
