"""A prefill-capable engine's prefix cache, as the gateway's router reads it (Prefill.CacheReport).

A worker answers with `report(loop)`, which never waits for the engine thread: the first call
makes the loop move the engine's prefix events into this reporter after every pass
(`EngineLoop.observe`), and each call hands over the events gathered since the previous one
(so the one reader, the cluster's gateway, sees each event once) with the counters of the
loop's latest snapshot. Events the engine produced before the first call arrive with the next.
"""

from __future__ import annotations

import threading
import uuid
from typing import TYPE_CHECKING

from splitserve.v1 import prefill_pb2

if TYPE_CHECKING:
    from splitserve.engine.engine_loop import EngineLoop
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.prefix_cache.events import PrefixEvent
    from splitserve.engine.prefix_cache.stats import PrefixCacheStats


class CacheReporter:
    """Owns this worker's instance id (a new engine, i.e. a restarted worker at the same address,
    reports a new one, so the router forgets what the old engine held) and the prefix events
    taken from the engine but not yet reported."""

    def __init__(self) -> None:
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: list[PrefixEvent] = []
        self._loop: EngineLoop | None = None  # the loop that feeds `collect`, once attached

    def collect(self, engine: LLMEngine) -> None:
        """Move the engine's new prefix events here (on the engine thread)."""
        events = engine.take_prefix_events()
        if events:
            with self._lock:
                self._events.extend(events)

    def report(self, loop: EngineLoop) -> prefill_pb2.PrefixCacheReport:
        """The events gathered since the last report and the counters as of the engine's last
        pass; from any thread, without waiting for a step in progress."""
        with self._lock:
            if self._loop is not loop:
                self._loop = loop
                loop.observe(self.collect)  # not awaited: it runs when the loop's pass ends
            events, self._events = self._events, []
        return self._build(events, loop.snapshot().prefix_cache)

    def take(self, engine: LLMEngine) -> prefill_pb2.PrefixCacheReport:
        """The same report made on the thread that drives `engine` (no loop; offline and tests)."""
        self.collect(engine)
        with self._lock:
            events, self._events = self._events, []
        return self._build(events, engine.prefix_cache_stats())

    def _build(self, events: list[PrefixEvent], stats: PrefixCacheStats) -> prefill_pb2.PrefixCacheReport:
        return prefill_pb2.PrefixCacheReport(
            instance_id=self.instance_id,
            events=[
                prefill_pb2.PrefixEvent(
                    stored=event.kind == "stored", block_hash=event.block_hash, num_tokens=event.num_tokens
                )
                for event in events
            ],
            num_queried_tokens=stats.num_queried_tokens,
            num_hit_tokens=stats.num_hit_tokens,
            num_imported_tokens=stats.num_imported_tokens,
            num_lost_to_missing_state_tokens=stats.num_lost_to_missing_state_tokens,
            num_snapshots=stats.num_snapshots,
            snapshot_bytes=stats.snapshot_bytes,
            num_evictions=stats.num_evictions,
        )
