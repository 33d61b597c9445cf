"""Local-disk tier: one file per object under a private directory, bounded in bytes, LRU."""

from __future__ import annotations

import itertools
import os
from collections.abc import Hashable
from pathlib import Path

from splitserve.state.errors import CorruptStateError
from state_store.lru import LruTier
from state_store.tier import Evicted
from state_store.tier_directory import ClaimedDirectory, reclaim_abandoned


class DiskTier(LruTier):
    """Holds objects as files in a fresh directory under `root`, up to `capacity_bytes`.

    Owns that directory (a fresh one, so stores sharing a root never collide) and every file in
    it; `close` deletes the directory. Files are written to a temporary name and renamed, so a
    reader never sees half a file. Evicted files are deleted at once (`Evicted.data` is None).
    Nothing survives a restart: leases die with the store, and the directories of stores that
    died without closing are deleted when the next tier starts on the same root
    (`tier_directory`). See `Tier` for the locking, eviction and pin contract; file I/O runs
    under the tier's lock.
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.reclaimed_bytes = reclaim_abandoned(root)
        self._claim = ClaimedDirectory(root)
        self.directory = self._claim.path
        self._paths: dict[Hashable, Path] = {}
        self._names = itertools.count()

    def path_of(self, oid: Hashable) -> Path | None:
        """The file holding `oid` (for debugging and tests), or None."""
        with self._lock:
            return self._paths.get(oid)

    def put(self, oid: Hashable, data: bytes | memoryview) -> list[Evicted]:
        with self._lock:
            victims = self._index.victims(oid, len(data))
            for victim in victims:
                self._delete_locked(victim)
            path = self._paths.get(oid) or self.directory / f"{next(self._names):012d}.bin"
            partial = path.with_suffix(".partial")
            partial.write_bytes(data)
            os.replace(partial, path)
            self._paths[oid] = path
            self._index.add(oid, len(data))
            return [Evicted(v, None) for v in victims]

    def get(self, oid: Hashable) -> bytes | None:
        with self._lock:
            path = self._paths.get(oid)
            if path is None:
                return None
            self._index.touch(oid)
            try:
                return path.read_bytes()
            except FileNotFoundError as e:
                raise CorruptStateError(f"disk tier file {path} for {oid} vanished") from e

    def remove(self, oid: Hashable) -> int:
        with self._lock:
            return self._delete_locked(oid)

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._paths.clear()
            self._claim.release()

    def _delete_locked(self, oid: Hashable) -> int:
        path = self._paths.pop(oid, None)
        if path is not None:
            path.unlink(missing_ok=True)
        return self._index.discard(oid)
