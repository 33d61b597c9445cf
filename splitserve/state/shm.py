"""The client's side of a store's shared-memory arena: proving it shares the node, mapping regions.

A region is a file in the arena's directory (state_store/arena.py). A writer maps it read-write
and copies a piece of state in once; a reader maps it read-only and hands out memoryviews of it,
so the engine scatters straight from the store's pages. A mapping stays valid after the store
frees the region (freeing unlinks the file), until its last view is dropped.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from splitserve.state.errors import StateUnavailableError


class LocalArena:
    """A store's arena as seen from a process on the same node: maps regions by name."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    @classmethod
    def probe(cls, directory: str, probe_name: str, probe_token: bytes) -> LocalArena | None:
        """The arena if this process sees its probe file with the store's token, else None (the
        store is on another node, in another container, or has no arena)."""
        if not directory or not probe_token:
            return None
        try:
            seen = (Path(directory) / probe_name).read_bytes()
        except OSError:
            return None
        return cls(directory) if seen == probe_token else None

    def map(self, region: str, *, writable: bool = False) -> memoryview:
        """The whole region as a byte memoryview (read-only unless `writable`)."""
        path = self.directory / region
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise StateUnavailableError(
                f"shared-memory region {path} is gone: its key was released or expired"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return memoryview(b"")
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            return memoryview(mmap.mmap(fd, size, access=access))
        finally:
            os.close(fd)
