"""Plain records the store hands out: its config, what a key holds, what a release freed, stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from state_store.chunk import MAX_CHUNK_BYTES, ChunkMeta
from state_store.tier import TierStats


@dataclass(frozen=True)
class StoreConfig:
    """How big each tier is and how long unclaimed state lives. `disk_path=None`: no disk tier."""

    memory_bytes: int = 2 << 30
    disk_path: str | None = None
    disk_bytes: int = 0
    default_lease_s: float = 60.0
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    num_tombstones: int = 65536  # gone keys remembered, so a late read says why it failed

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise ValueError(
                f"store tier sizes must be >= 0 (memory {self.memory_bytes}, disk {self.disk_bytes})"
            )
        if self.disk_path is not None and self.disk_bytes == 0:
            raise ValueError(
                f"store disk tier at {self.disk_path!r} has 0 bytes; set disk_bytes or drop disk_path"
            )
        if not self.default_lease_s > 0:
            raise ValueError(f"default_lease_s must be > 0 seconds (got {self.default_lease_s})")


@dataclass(frozen=True)
class KeyInfo:
    """What one stored key holds right now (metadata only)."""

    key: str
    owner: str
    sealed: bool
    num_bytes: int
    lease_remaining_s: float
    chunks: tuple[ChunkMeta, ...]

    @property
    def num_layers(self) -> int:
        return len({c.layer for c in self.chunks})


class ReleaseResult(NamedTuple):
    """What a release freed."""

    num_keys: int
    num_bytes: int


@dataclass
class StoreStats:
    """Counters since the store started, and what each tier holds now."""

    tiers: list[TierStats] = field(default_factory=list)
    num_keys: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_prefix_hits: int = 0
    num_spills: int = 0
    num_evictions: int = 0
    num_expiries: int = 0
    num_releases: int = 0
    num_corruptions: int = 0

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tiers)

    @property
    def num_objects(self) -> int:
        return sum(t.num_objects for t in self.tiers)
