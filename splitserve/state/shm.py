"""The client's side of a store's shared-memory arena: proving it shares the node, mapping regions.

A region is a file in the arena's directory (state_store/arena.py). A writer maps it read-write
and copies a piece of state in once; a reader maps it read-only and hands out memoryviews of it,
so the engine scatters straight from the store's pages. A mapping stays valid after the store
frees the region (freeing unlinks the file), until its last view is dropped.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from splitserve.state.errors import StateUnavailableError
from splitserve.state.mapping import map_file

MAPPING_CACHE_BYTES = 1 << 30  # a client's mappings of a store's regions kept for reuse


class LocalArena:
    """A store's arena as seen from a process on the same node: maps regions by name.

    Keeps its mappings (up to `cache_bytes`, least recently used dropped first): the store
    reuses freed regions under their names, so a mapping made once serves later transfers
    without a new mmap or page faults. Thread-safe.
    """

    def __init__(self, directory: str, cache_bytes: int = MAPPING_CACHE_BYTES) -> None:
        self.directory = Path(directory)
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._mapped: OrderedDict[tuple[str, bool], memoryview] = OrderedDict()
        self._mapped_bytes = 0

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
        """The whole region as a byte memoryview (read-only unless `writable`); cached."""
        with self._lock:
            view = self._mapped.get((region, writable))
            if view is not None:
                self._mapped.move_to_end((region, writable))
                return view
        view = self._map(region, writable)
        with self._lock:
            self._mapped[(region, writable)] = view
            self._mapped_bytes += view.nbytes
            while self._mapped_bytes > self.cache_bytes and len(self._mapped) > 1:
                _, dropped = self._mapped.popitem(last=False)  # views handed out keep it alive
                self._mapped_bytes -= dropped.nbytes
        return view

    def read(self, region: str, offset: int, num_bytes: int) -> memoryview:
        """The bytes of `region` at [offset, offset + num_bytes): a read-only view, no copy."""
        return self.map(region)[offset : offset + num_bytes]

    def read_many(self, places: list[tuple[str, int, int]]) -> list[memoryview]:
        """`read` of each (region, offset, num_bytes)."""
        return [self.read(*place) for place in places]

    def _map(self, region: str, writable: bool) -> memoryview:
        path = self.directory / region
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise StateUnavailableError(
                f"shared-memory region {path} is gone: its key was released or expired"
            ) from None
        try:
            # MAP_POPULATE: map every page now, not one fault per 4 KiB during the copy; the
            # mapping keeps no fd open (a process maps one region per retained prefix)
            return map_file(fd, os.fstat(fd).st_size, writable=writable, populate=True)
        finally:
            os.close(fd)


MIN_SLAB_BYTES = 8 << 20  # a writer's first region, unless told the state's size or a piece is larger
MAX_SLAB_BYTES = 256 << 20  # regions double up to this, so a big state needs few Allocate calls
ALIGN_BYTES = 64  # every piece starts aligned (a cache line), so any dtype can view it in place
SLACK_BYTES = 64 << 10  # room an expected size gets for alignment padding (1,024 pieces' worth)
SPARE_PREFIX = "spare-region/"  # keys of regions writers lease ahead for their next put


def first_region_bytes(expected_bytes: int) -> int:
    """The first region of a writer that expects `expected_bytes` in all: those, plus padding."""
    return expected_bytes + SLACK_BYTES

# (layer, kind name, num_bytes) -> the name of a fresh region of the store's arena for the key
RegionAllocator = Callable[[int, str, int], str]


class SlabWriter:
    """Places one key's pieces in regions it asks the store for, several pieces per region.

    Owns its current region's writable mapping. Regions start at `expected_bytes` (if the writer
    knows the state's size: then one region holds it all) or `MIN_SLAB_BYTES`, and double up to
    `MAX_SLAB_BYTES`; a piece never straddles two. `first_region` gives the first region of
    `expected_bytes` if it was asked for early (`open_put` does, so the Allocate round trip
    overlaps the prefill's first layer). Not thread-safe (a Put's sending thread).
    """

    def __init__(
        self,
        arena: LocalArena,
        allocate: RegionAllocator,
        expected_bytes: int | None = None,
        first_region: Callable[[], str] | None = None,
    ) -> None:
        self.arena, self._allocate = arena, allocate
        self._first_region = first_region if expected_bytes else None  # one of expected_bytes, asked early
        self._next_bytes = first_region_bytes(expected_bytes) if expected_bytes else MIN_SLAB_BYTES
        self._region = ""
        self._view = memoryview(b"")
        self._used = 0

    def place(self, layer: int, kind: str, data: memoryview) -> tuple[str, int, memoryview]:
        """Copies `data` (bytes) into a region once; (region, offset, the copy) for its commit."""
        num_bytes = data.nbytes
        offset = -(-self._used // ALIGN_BYTES) * ALIGN_BYTES
        if offset + num_bytes > self._view.nbytes:
            size = max(num_bytes, self._next_bytes)
            early = self._first_region if size == self._next_bytes else None  # the piece fits it
            self._first_region = None
            self._next_bytes = min(2 * size, MAX_SLAB_BYTES)
            self.close()
            self._region = early() if early is not None else self._allocate(layer, kind, size)
            self._view = self.arena.map(self._region, writable=True)
            offset = 0
        target = self._view[offset : offset + num_bytes]
        # numpy's copy releases the GIL (a memoryview slice assignment holds it for the whole
        # copy), so the process's other threads (the gRPC sender, a reader) run alongside
        np.copyto(np.frombuffer(target, np.uint8), np.frombuffer(data, np.uint8))
        self._used = offset + num_bytes
        return self._region, offset, target

    def close(self) -> None:
        """Forgets the current region (its mapping stays in the arena's cache)."""
        self._view = memoryview(b"")
