"""A memory tier in front of an optional disk tier: where each chunk's bytes live, and spilling."""

from __future__ import annotations

from typing import NamedTuple

from splitserve.state.chunk import ChunkId
from splitserve.state.errors import StoreFullError, TierFullError
from splitserve.state.records import TierStats
from state_store.tier import Tier


class RegionId(NamedTuple):
    """The memory tier's id of a key's arena region (counted there, pinned, never spilled)."""

    key: str
    region: str


class TieredStorage:
    """Places chunk bytes in memory first; what memory evicts spills to disk; what disk evicts is lost.

    Owns both tiers (`close` closes them). Knows nothing of keys beyond reporting which keys
    lost a chunk, so the store can drop them whole. Reads (`fetch`) are safe from any thread;
    writes that move bytes between tiers (`put`) must be serialised by the caller, and a reader
    that misses in both tiers should look again under that serialisation (a chunk in flight from
    memory to disk is briefly in neither).
    """

    def __init__(self, memory: Tier, disk: Tier | None = None) -> None:
        self.memory, self.disk = memory, disk
        self.num_spills = 0

    def put(
        self,
        cid: ChunkId | RegionId,
        data: bytes | memoryview,
        *,
        pin: bool = False,
        memory_only: bool = False,
    ) -> list[tuple[str, str]]:
        """Stores `data`; returns (key, why) for every key that lost a chunk to make room.

        Raises `StoreFullError` if neither tier can take it (nothing is lost then); with
        `memory_only` (an arena region, which lives in RAM) if memory cannot.
        """
        try:
            evicted = self.memory.put(cid, data)
        except TierFullError as memory_full:
            if self.disk is None or memory_only:
                raise StoreFullError(f"{memory_full}; there is no disk tier") from None
            try:
                evicted = self.disk.put(cid, data)
            except TierFullError as disk_full:
                raise StoreFullError(f"{memory_full}; {disk_full}") from None
        if pin:
            self.tier_of(cid).pin(cid)
        lost: list[tuple[str, str]] = []
        for oid, spilled in evicted:
            key = oid.key  # type: ignore[attr-defined]
            if spilled is None:
                lost.append((key, "the disk tier was full"))
            elif self.disk is None:
                lost.append((key, "the memory tier was full and there is no disk tier"))
            else:
                lost.extend(self._spill(oid, spilled))  # type: ignore[arg-type]
        return lost

    def fetch(self, cid: ChunkId) -> bytes | memoryview | None:
        data = self.memory.get(cid)
        if data is None and self.disk is not None:
            data = self.disk.get(cid)
        return data

    def tier_of(self, cid: ChunkId | RegionId) -> Tier:
        if self.disk is not None and not self.memory.contains(cid):
            return self.disk
        return self.memory

    def remove(self, cid: ChunkId | RegionId) -> None:
        self.memory.remove(cid)
        if self.disk is not None:
            self.disk.remove(cid)

    def stats(self) -> list[TierStats]:
        return [self.memory.stats()] + ([self.disk.stats()] if self.disk is not None else [])

    def close(self) -> None:
        self.memory.close()
        if self.disk is not None:
            self.disk.close()

    def _spill(self, cid: ChunkId, data: bytes | memoryview) -> list[tuple[str, str]]:
        assert self.disk is not None
        try:
            dropped = self.disk.put(cid, data)
        except TierFullError as e:
            return [(cid.key, f"it spilled from memory and {e}")]
        self.num_spills += 1
        return [(oid.key, "the disk tier was full") for oid, _ in dropped]  # type: ignore[attr-defined]
