"""A prefill-capable engine's prefix cache, as the gateways' routers read it (Prefill.CacheReport).

A worker answers with `report(loop, request)`, which never waits for the engine thread: the first
call makes the loop move the engine's prefix events into this reporter after every pass
(`EngineLoop.observe`). Each event gets the next sequence number and goes into a bounded log;
the reporter also keeps the set of units usable now (every event applied). A reader (a gateway)
names its cursor, the instance and the last sequence number it applied, and gets the events
after it; a reader without a cursor, or whose cursor the log no longer reaches (or names another
instance: the worker restarted), gets a snapshot: every unit usable now. So any number of
gateways each see every change, none drains another's. Events the engine produced before the
first call arrive with the next.
"""

from __future__ import annotations

import collections
import itertools
import threading
import uuid
from typing import TYPE_CHECKING

from splitserve.v1 import prefill_pb2

if TYPE_CHECKING:  # a GPU-less node imports this module, and the engine's package imports torch
    from splitserve.engine.engine_loop import EngineLoop
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.prefix_cache.events import PrefixEvent
    from splitserve.engine.prefix_cache.stats import PrefixCacheStats

# Events kept for readers that are behind; one further behind gets a snapshot (a few MiB at most).
MAX_LOGGED_EVENTS = 16_384


class CacheReporter:
    """Owns this worker's instance id (a new engine, i.e. a restarted worker at the same address,
    reports a new one, so the routers forget what the old engine held), the log of the last
    `max_logged_events` prefix events with their sequence numbers, and the units usable now."""

    def __init__(self, max_logged_events: int = MAX_LOGGED_EVENTS) -> None:
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._log: collections.deque[tuple[int, PrefixEvent]] = collections.deque(maxlen=max_logged_events)
        self._last_seq = 0
        self._usable: dict[bytes, int] = {}  # unit name -> the tokens its hit covers, as of _last_seq
        self._loop: EngineLoop | None = None  # the loop that feeds `collect`, once attached

    def collect(self, engine: LLMEngine) -> None:
        """Move the engine's new prefix events here (on the engine thread)."""
        events = engine.take_prefix_events()
        if not events:
            return
        with self._lock:
            for event in events:
                self._last_seq += 1
                self._log.append((self._last_seq, event))
                if event.kind == "stored":
                    self._usable[event.block_hash] = event.num_tokens
                else:
                    self._usable.pop(event.block_hash, None)

    def report(
        self, loop: EngineLoop, request: prefill_pb2.CacheReportRequest | None = None
    ) -> prefill_pb2.PrefixCacheReport:
        """What the reader at `request`'s cursor has not seen, and the counters as of the
        engine's last pass; from any thread, without waiting for a step in progress."""
        with self._lock:
            if self._loop is not loop:
                self._loop = loop
                loop.observe(self.collect)  # not awaited: it runs when the loop's pass ends
        return self._build(request, loop.snapshot().prefix_cache)

    def take(
        self, engine: LLMEngine, request: prefill_pb2.CacheReportRequest | None = None
    ) -> prefill_pb2.PrefixCacheReport:
        """The same report made on the thread that drives `engine` (no loop; offline and tests)."""
        self.collect(engine)
        return self._build(request, engine.prefix_cache_stats())

    def _since(self, request: prefill_pb2.CacheReportRequest | None) -> tuple[list[PrefixEvent], bool]:
        """(events, whether they are a snapshot) for the reader at `request`'s cursor."""
        oldest_seq = self._log[0][0] if self._log else self._last_seq + 1
        if (
            request is not None
            and request.instance_id == self.instance_id
            and oldest_seq - 1 <= request.after_seq <= self._last_seq
        ):
            skip = request.after_seq - oldest_seq + 1  # sequence numbers in the log are consecutive
            return [event for _, event in itertools.islice(self._log, skip, None)], False
        # only a worker with an engine gets here: the engine's package imports torch
        from splitserve.engine.prefix_cache.events import PrefixEvent

        return [PrefixEvent("stored", name, n) for name, n in self._usable.items()], True

    def _build(
        self, request: prefill_pb2.CacheReportRequest | None, stats: PrefixCacheStats
    ) -> prefill_pb2.PrefixCacheReport:
        with self._lock:
            events, snapshot = self._since(request)
            last_seq = self._last_seq
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
            last_seq=last_seq,
            snapshot=snapshot,
        )
