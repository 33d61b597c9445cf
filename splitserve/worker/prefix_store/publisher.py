"""Publishes the prefixes an engine retains to its node's store, off the engine thread.

The engine's retention listener (`LLMEngine.set_retention_listener`) hands over a copy of each
retained prefix's whole state on the engine thread; `offer` only queues it. One sending thread
writes each under a key of its own with the handoff's piece encoding (`state_codec.write_state`),
seals it, and registers it in the store's prefix index under its hash chain and tail tokens, so
any prefill worker that asks the store (`PrefixFetcher`) can stream it in instead of computing
it. The store then keeps it until it must evict it (`StateStore.register`). On a decode worker
the thread first waits out any prompt the engine is computing (`PrefillYield`): a conversation's
next turn arrives there right after the finish that retained its history.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.state.client import StateStoreClient
from splitserve.worker.prefix_store.prefill_yield import PrefillYield

if TYPE_CHECKING:
    from splitserve.engine.engine_loop import EngineLoop
    from splitserve.engine.prefix_cache.retained import RetainedPrefix

logger = logging.getLogger(__name__)

OWNER = "prefix-cache"  # not the worker's id: a worker's restart or release frees its own keys, not these
CLIENT_TIMEOUT_S = 10.0  # a store that does not answer a lookup or registration this fast: count a failure
WRITE_LEASE_S = 120.0  # until Register retains the key; a write that never registers frees itself
WRITE_TIMEOUT_S = 60.0  # a write the store has not acknowledged by then is abandoned (and counted)
HOLD_BYTES = 1 << 20  # pieces under this many bytes go in one message (a large model's: one each)


@dataclass
class PublisherStats:
    """What the publisher did since it started (read from any thread; counters only grow)."""

    num_published: int = 0  # written, sealed and registered
    num_already_stored: int = 0  # the store already held as long a state of that prefix
    num_dropped: int = 0  # the queue was full (the store is slow): never written
    num_too_short: int = 0  # shorter than one prefix unit: nothing to name it by
    num_failed: int = 0  # the store refused the write or the registration
    num_bytes: int = 0  # state bytes published
    num_held_past_wait: int = 0  # started with a prompt still waiting: the hold's wait ran out

    def counters(self) -> dict[str, int]:
        """What a worker's `stats` report of its publisher (deploy/README.md lists them)."""
        return {
            "prefix_published": self.num_published,
            "prefix_publish_dropped": self.num_dropped,
            "prefix_publish_failures": self.num_failed,
        }


class PrefixPublisher:
    """Owns a bounded queue of retained prefixes and the thread that writes them to one store.

    Promises: `offer` never blocks (a full queue drops the prefix and counts it); a prefix is
    registered only after every piece of it is stored and sealed, so the store never advertises
    a partial state; a failed write is logged and counted, never raised. `close` stops the
    thread (what is still queued is dropped).
    """

    def __init__(
        self,
        client: StateStoreClient,
        worker_id: str,
        max_pending: int = 4,
        hold: Callable[[float], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.stats = PublisherStats()
        # called on the thread before a publish with the time (`clock`) the prefix was offered;
        # returns when it may start (False: its wait ran out). Skipped while others queue behind
        # it, so a hold never lowers how many prefixes are published per second under load.
        self.hold = hold
        self.clock = clock
        self._queue: queue.Queue[tuple[float, RetainedPrefix] | None] = queue.Queue(max_pending)
        self._name = uuid.uuid4().hex[:16]  # keys unique across workers, also two in one process
        self._seq = itertools.count()
        self._owns_client = False  # `attach` made the client: `close` closes it
        self._idle = threading.Condition()
        self._busy = 0  # offered and not yet written or dropped
        self._thread = threading.Thread(target=self._run, name=f"prefix-publisher-{worker_id}", daemon=True)
        self._thread.start()

    def offer(self, prefix: RetainedPrefix) -> None:
        """Queue one retained prefix (engine thread: never blocks)."""
        if not prefix.hash_chain:
            self.stats.num_too_short += 1
            return
        with self._idle:
            self._busy += 1
        try:
            self._queue.put_nowait((self.clock(), prefix))
        except queue.Full:
            self.stats.num_dropped += 1
            self._done()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every prefix offered so far was written or dropped; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        while True:  # make room for the stop marker: what is still queued is dropped
            try:
                self._queue.put_nowait(None)
                break
            except queue.Full:
                try:
                    if self._queue.get_nowait() is not None:
                        self.stats.num_dropped += 1
                        self._done()
                except queue.Empty:
                    pass
        self._thread.join(timeout_s)
        if self._owns_client:
            self.client.close()

    @classmethod
    def attach(
        cls, loop: EngineLoop, worker_id: str, store_address: str, yield_to_prefills: bool = False
    ) -> PrefixPublisher | None:
        """A publisher of `loop`'s engine's retained prefixes to the store at `store_address` (a
        client of its own), listening from now on; None when the engine caches no prefixes or
        there is no store. `yield_to_prefills` (a decode worker, whose prompts are the
        latency-critical part of its steps): each publish waits out the prompts the engine is
        computing (`PrefillYield`). `detach` it before the loop stops. A tensor-parallel engine's
        prefixes come with every rank's KDA heads, one piece per rank (engine/parallel/retained.py)."""
        if not store_address or not loop.engine.config.enable_prefix_caching:
            return None
        client = StateStoreClient(store_address, timeout_s=CLIENT_TIMEOUT_S)
        hold = PrefillYield(loop) if yield_to_prefills else None
        publisher = cls(client, worker_id, hold=hold)  # both on time.monotonic
        publisher._owns_client = True
        loop.call(lambda e: e.set_retention_listener(publisher.offer)).result()
        return publisher

    def detach(self, loop: EngineLoop) -> None:
        """Stop listening to `loop`'s engine, then `close`."""
        if loop.alive:
            loop.call(lambda e: e.set_retention_listener(None)).result()
        self.close()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            offered_s, prefix = item
            try:
                if self.hold is not None and self._queue.empty() and not self.hold(offered_s):
                    self.stats.num_held_past_wait += 1
                self._publish(prefix)
            except Exception as exc:  # noqa: BLE001 - a store error or a bug: count it, keep the thread
                self.stats.num_failed += 1
                logger.warning(
                    "publishing a %d-token prefix to %s failed: %s",
                    prefix.num_tokens,
                    self.client.address,
                    exc,
                )
            finally:
                self._done()

    def _publish(self, prefix: RetainedPrefix) -> None:
        tail = list(prefix.tail_token_ids)
        probe = [-1] * (prefix.num_tokens - len(tail)) + tail  # the chain stands for the units' tokens
        held = self.client.match_prefix(prefix.hash_chain, probe)
        if held.num_units == len(prefix.hash_chain) and held.num_tokens >= prefix.num_tokens:
            self.stats.num_already_stored += 1
            return
        key = f"prefix-{self._name}-{next(self._seq)}"
        num_bytes = self._write(prefix, key)
        self.client.register(prefix.hash_chain, key, tail_token_ids=tail, num_tokens=prefix.num_tokens)
        self.stats.num_published += 1
        self.stats.num_bytes += num_bytes

    def _write(self, prefix: RetainedPrefix, key: str) -> int:
        """Stores and seals every piece of `prefix` under `key`; returns its bytes. On this node
        the pieces go into the store's shared-memory arena (one copy, and a fetch on the node
        reads them in place); else as bytes over gRPC. A device's pieces go through pinned
        buffers (`state_codec.write_state`), read on the put's sending thread."""
        from splitserve.engine.state_codec import write_state  # the engine's side: package docstring

        num_bytes = sum(state.num_bytes for state in prefix.states)
        # warm_next: the publisher puts after every retained prefix, so each put starts on a call
        # (and gRPC's request-consuming thread) opened when the previous put was acknowledged,
        # not at its own start; hold_bytes: the pieces, written back to back, go in as few
        # messages as their size allows
        put = self.client.open_put(
            key,
            owner=OWNER,
            lease_s=WRITE_LEASE_S,
            expected_bytes=num_bytes,
            hold_bytes=HOLD_BYTES,
            warm_next=True,
        )
        held = []  # what the put reads, until finish
        try:
            for state in prefix.states:
                held.append(write_state(put, state))
            put.finish(WRITE_TIMEOUT_S)
        except BaseException:
            put.cancel()
            raise
        return num_bytes

    def _done(self) -> None:
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()
