"""The store's shared-memory arena: one file per region in a claimed directory under /dev/shm.

Writers and readers on the store's node `mmap` a region's file by name, so a piece of state is
copied once (into the region) and read in place. A region is its own file, so the kernel does
the allocating, and freeing is an unlink: a reader that still maps a freed region keeps its
pages until it drops the mapping, and nothing is ever reused under it.

The directory is claimed like a disk tier's (`tier_directory`): the store holds a flock on its
`.owner` file while it lives, and a store starting on the same root deletes every sibling
directory whose lock it can take, so the regions of a store that was SIGKILLed are reclaimed by
the next store on the node. A writer that dies holding regions leaves them under its key, which
its lease frees.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.state.errors import StoreFullError
from state_store.tier_directory import ClaimedDirectory, reclaim_abandoned

DEFAULT_ROOT = "/dev/shm/splitserve-arenas"
PROBE_NAME = ".probe"


@dataclass
class Region:
    """One region: its file name in the arena, its size, and the store's own mapping of it."""

    name: str
    num_bytes: int
    view: memoryview = field(repr=False)


class Arena:
    """Owns a claimed directory of region files under `root` (`close` deletes it).

    Thread-safe. Capacity is not counted here: the store counts regions against its memory tier.
    """

    def __init__(self, root: str | os.PathLike[str] = DEFAULT_ROOT) -> None:
        self.reclaimed_bytes = reclaim_abandoned(root)
        self._claim = ClaimedDirectory(root)
        self.directory = self._claim.path
        self.probe_token = secrets.token_bytes(16)
        (self.directory / PROBE_NAME).write_bytes(self.probe_token)
        self._names = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def open_default(cls, root: str | None) -> Arena | None:
        """An arena under `root`, or None when `root` is None or its filesystem is missing."""
        if root is None or not Path(root).parent.is_dir():
            return None
        return cls(root)

    def allocate(self, num_bytes: int) -> Region:
        """A fresh zero-filled region of `num_bytes`, mapped read-write by the store.

        Raises `StoreFullError` if the arena's filesystem has no room for it."""
        if num_bytes < 0:
            raise ValueError(f"a region needs >= 0 bytes (got {num_bytes})")
        with self._lock:
            name = f"{next(self._names):012d}.region"
        path = self.directory / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if num_bytes:  # reserve the pages now: a full tmpfs is an error here, not a SIGBUS later
                os.posix_fallocate(fd, 0, num_bytes)
            mapped = mmap.mmap(fd, num_bytes) if num_bytes else None
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise StoreFullError(f"no room for a {num_bytes}-byte region in {self.directory}: {e}") from None
        os.close(fd)
        return Region(name, num_bytes, memoryview(mapped) if mapped is not None else memoryview(b""))

    def free(self, region: Region) -> None:
        """Unlinks the region's file (mappings others still hold stay valid until dropped)."""
        (self.directory / region.name).unlink(missing_ok=True)

    def close(self) -> None:
        self._claim.release()
