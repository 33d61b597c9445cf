"""A stand-in engine for `CacheReporter` whose prefix events are the ones a test queues."""

from __future__ import annotations

from splitserve.engine.prefix_cache.events import PrefixEvent
from splitserve.engine.prefix_cache.stats import PrefixCacheStats


class QueuedPrefixEvents:
    """What `CacheReporter.take` reads of an engine: the events queued in `pending`, and zero counters."""

    def __init__(self) -> None:
        self.pending: list[PrefixEvent] = []

    def take_prefix_events(self) -> list[PrefixEvent]:
        events, self.pending = self.pending, []
        return events

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats()
