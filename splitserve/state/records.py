"""Plain records a store hands out, locally or over gRPC: what a key holds, what a release freed,
what each tier and the whole store hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from splitserve.state.chunk import ChunkMeta


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


class PrefixMatch(NamedTuple):
    """The longest stored prefix of a query: its whole units, the key holding its state and the
    tokens that state covers (units plus a tail inside the next unit). (0, None, 0): none."""

    num_units: int
    key: str | None
    num_tokens: int


NO_PREFIX_MATCH = PrefixMatch(0, None, 0)


class ReleaseResult(NamedTuple):
    """What a release freed."""

    num_keys: int
    num_bytes: int


@dataclass(frozen=True)
class TierStats:
    """What one storage tier holds now."""

    name: str
    num_bytes: int
    capacity_bytes: int
    num_objects: int
    num_pinned: int
    num_keys: int = 0  # distinct keys with at least one object in this tier


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
    num_prefix_lookups: int = 0  # prefix queries answered
    num_prefix_hit_tokens: int = 0  # tokens their hits covered
    num_prefix_evictions: int = 0  # retained prefixes dropped (budget, tiers, corruption)
    num_prefix_keys: int = 0  # retained prefixes held now
    num_prefix_bytes: int = 0  # their bytes now

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tiers)

    @property
    def num_objects(self) -> int:
        return sum(t.num_objects for t in self.tiers)
