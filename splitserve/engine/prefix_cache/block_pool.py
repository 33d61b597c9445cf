"""KV blocks shared between requests and kept after them, indexed by the prefix they hold."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.engine.cache_pool import BlockAllocator


@dataclass
class KVEntry:
    """The blocks holding one prefix piece's KV rows: a whole prefix unit, or a tail (the tokens
    of a boundary inside a unit, its last block partial) named after that boundary."""

    block_ids: tuple[int, ...]
    num_tokens: int  # rows of this piece (a unit's length, or a tail's)


class CachingBlockAllocator(BlockAllocator):
    """Owns every KV block id: free, used by requests (ref-counted), or kept in the index.

    A block is referenced by each request holding it in its block table, and may belong to index
    entries (`KVEntry`, by key). It returns to the free list only when neither holds it. Entries
    none of whose blocks a request holds are evictable, least recently used first; they are
    evicted only when `allocate` needs their blocks, and `on_evict(key)` hears of each.
    `allocate` is all-or-nothing like the plain allocator's, and `num_free_blocks` counts blocks
    it could hand out (free, or kept but evictable).
    """

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._entries_of: list[set[bytes]] = [set() for _ in range(num_blocks)]
        self.index: OrderedDict[bytes, KVEntry] = OrderedDict()  # oldest first
        self._num_idle_kept = 0  # blocks in some entry that no request holds
        self.on_evict: Callable[[bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self._num_idle_kept

    def allocate(self, count: int) -> list[int] | None:
        if count > self.num_free_blocks:
            return None
        while len(self._free) < count:
            self._evict_one()
        return self._take(count)

    def share(self, block_ids: list[int] | tuple[int, ...]) -> None:
        """A request takes kept blocks into its block table (they stay in the index)."""
        for b in block_ids:
            if self._refs[b] == 0 and self._entries_of[b]:
                self._num_idle_kept -= 1
            self._refs[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """A request lets go of its blocks; kept ones stay indexed, deepest ones evicted first."""
        for b in reversed(block_ids):
            self._refs[b] -= 1
            if self._refs[b] > 0:
                continue
            if self._entries_of[b]:
                self._num_idle_kept += 1
                for key in self._entries_of[b]:
                    self.index.move_to_end(key)  # the root-most entries end up most recent
            else:
                self._free.append(b)

    def insert(self, key: bytes, block_ids: list[int], num_tokens: int) -> bool:
        """Index blocks a request holds under `key`; False (nothing changes) if `key` is indexed."""
        if key in self.index:
            return False
        self.index[key] = KVEntry(tuple(block_ids), num_tokens)
        for b in block_ids:
            if not self._entries_of[b] and self._refs[b] == 0:
                self._num_idle_kept += 1
            self._entries_of[b].add(key)
        return True

    def lookup(self, key: bytes) -> KVEntry | None:
        return self.index.get(key)

    def touch(self, key: bytes) -> None:
        if key in self.index:
            self.index.move_to_end(key)

    def evict(self, key: bytes) -> None:
        """Drop one entry now (whether or not a request holds its blocks; they stay theirs)."""
        entry = self.index.pop(key)
        for b in entry.block_ids:
            self._entries_of[b].discard(key)
            if not self._entries_of[b] and self._refs[b] == 0:
                self._num_idle_kept -= 1
                self._free.append(b)
        if self.on_evict is not None:
            self.on_evict(key)

    def _evict_one(self) -> None:
        """Evict the least recently used entry no request holds a block of; failing that (a tail
        whose partial block was copied, the rest shared), one with at least one idle block."""
        for needs_all_idle in (True, False):
            for key, entry in self.index.items():
                idle = [self._refs[b] == 0 for b in entry.block_ids]
                if all(idle) if needs_all_idle else any(idle):
                    self.evict(key)
                    return
        raise AssertionError("num_free_blocks promised blocks that no entry can give")
