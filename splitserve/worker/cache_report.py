"""A prefill-capable engine's prefix cache, as the gateway's router reads it (Prefill.CacheReport).

Run on the engine thread (`loop.call(report.take)`): it drains the engine's prefix events, so the
one reader (the cluster's gateway) sees each event once.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from splitserve.v1 import prefill_pb2

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine


class CacheReporter:
    """Owns this worker's instance id: a new engine (a restarted worker at the same address)
    reports a new one, so the router forgets what the old engine held."""

    def __init__(self) -> None:
        self.instance_id = uuid.uuid4().hex

    def take(self, engine: LLMEngine) -> prefill_pb2.PrefixCacheReport:
        """The events since the last call and the engine's counters since it started."""
        stats = engine.prefix_cache_stats()
        events = [
            prefill_pb2.PrefixEvent(
                stored=event.kind == "stored", block_hash=event.block_hash, num_tokens=event.num_tokens
            )
            for event in engine.take_prefix_events()
        ]
        return prefill_pb2.PrefixCacheReport(
            instance_id=self.instance_id,
            events=events,
            num_queried_tokens=stats.num_queried_tokens,
            num_hit_tokens=stats.num_hit_tokens,
            num_imported_tokens=stats.num_imported_tokens,
            num_lost_to_missing_state_tokens=stats.num_lost_to_missing_state_tokens,
            num_snapshots=stats.num_snapshots,
            snapshot_bytes=stats.snapshot_bytes,
            num_evictions=stats.num_evictions,
        )
