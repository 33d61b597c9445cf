"""Counters of one engine's prefix cache since it started."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up, served from the local cache, and lost to a missing state.

    `num_lost_to_missing_state_tokens` counts tokens whose KV every MLA layer had but that no kept
    KDA snapshot reached (the KV matched further than the deepest usable snapshot): the miss that
    retention, not eviction of KV, caused. `num_imported_tokens` counts prompt tokens taken from an
    `ImportedPrefix` (a store hit) instead of computed. `num_evictions` counts KV entries (one
    prefix unit or prompt-end tail each) and snapshots evicted.
    """

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_lost_to_missing_state_tokens: int = 0
    num_imported_tokens: int = 0
    num_snapshots: int = 0
    snapshot_bytes: int = 0
    num_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
