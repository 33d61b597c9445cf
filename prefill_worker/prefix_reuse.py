"""A prefill worker's side of the cluster prefix cache: publish what its engine retains to the
node's store, and import from the stores what its engine would otherwise recompute."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.prefix_cache.imported import ImportedPrefix
from splitserve.prefix_hash import prefix_hash_chain
from splitserve.state.client import StateStoreClient
from splitserve.worker.prefix_store.fetcher import PrefixFetcher, StoredMatch
from splitserve.worker.prefix_store.publisher import PrefixPublisher

LOOKUP_TIMEOUT_S = 5.0  # a store that does not answer a lookup in this long is skipped: compute instead
# A stored prefix is imported when it covers at least this many prefix units past the engine's
# own hit. Measured (docs/PERFORMANCE.md section 9): a fetch costs ~10-15 ms on one node (a Lookup,
# then the whole stored prefix read, since a store Get has no token range), about what computing
# 64 more tokens of a turn costs the tiny model; a 31-token reply imported cost 3-24 ms more than
# computing it. The engine takes any gain (it writes only the rows past its hit): lower this once
# fetches read only the delta.
MIN_GAIN_UNITS = 1


class PrefixReuse:
    """Owns the publisher to this node's store and the clients of every store it looks prefixes up
    in (this node's first, then any the requests name, such as the decode target's).

    Promises: nothing here fails a request. A prompt whose chain the store matches further than
    the engine's own cache is served from the store's state; anything else (no match, a store
    down, a corrupt or incomplete state) computes the prompt as if caching were local only.
    """

    def __init__(
        self, loop: EngineLoop, worker_id: str, store_address: str, min_gain_tokens: int | None = None
    ) -> None:
        self.loop = loop
        self.store_address = store_address
        self.unit = loop.engine.config.prefix_unit
        self.salt = loop.engine.config.prefix_salt.encode()  # what the engine names prompts with itself
        self._clients: dict[str, StateStoreClient] = {}
        self._lock = threading.Lock()
        publisher = PrefixPublisher.attach(loop, worker_id, store_address)
        assert publisher is not None  # `enabled` said caching is on and there is a store
        self.publisher = publisher
        gain = MIN_GAIN_UNITS * self.unit if min_gain_tokens is None else min_gain_tokens
        # a tensor-parallel engine's rank 0 holds its heads: it reads the pieces of any width and
        # its engine hands every other rank its heads of them (`LLMEngine.add_request`)
        self.fetcher = PrefixFetcher(loop.engine.caches, min_gain_tokens=gain, heads=loop.engine.heads)

    @staticmethod
    def enabled(loop: EngineLoop, store_address: str) -> bool:
        # at any tensor-parallel width: a prefix is published with every rank's heads, and each
        # rank imports its own (parallel/retained.py, `ImportedPrefix.for_heads`)
        return bool(store_address) and bool(loop.engine.config.enable_prefix_caching)

    def chain_of(self, prompt_token_ids: Sequence[int], sent: Sequence[bytes] | None) -> list[bytes]:
        """The request's chain: the gateway's if it sent one, else the one the engine would make."""
        return list(sent) if sent else prefix_hash_chain(prompt_token_ids, self.unit, self.salt)

    def lookup(
        self, chain: list[bytes], prompt_token_ids: Sequence[int], other_store: str = ""
    ) -> StoredMatch | None:
        """The stores' longest match of this prompt (this node's store first, then `other_store`),
        or None; reads nothing yet, and never waits for the engine thread."""
        addresses = [self.store_address] + (
            [other_store] if other_store not in ("", self.store_address) else []
        )
        return self.fetcher.lookup([self._client(a) for a in addresses], chain, prompt_token_ids)

    def worth_reading(
        self, engine: LLMEngine, found: StoredMatch, chain: list[bytes], prompt_token_ids: Sequence[int]
    ) -> bool:
        """Whether `found` saves enough over what `engine`'s own cache serves (engine thread)."""
        return self.fetcher.worth_reading(found, engine.num_cached_prompt_tokens(prompt_token_ids, chain))

    def read(self, found: StoredMatch, chain: list[bytes]) -> ImportedPrefix | None:
        """The stored state of `found`, whole, or None (counted; the prompt is computed)."""
        return self.fetcher.read(found, chain)

    def refused(self, why: Exception) -> None:
        """The engine refused a fetched state (engine thread): count it like a failed fetch."""
        self.fetcher.count_failure(f"the engine refused it: {why}")

    def counters(self) -> dict[str, int]:
        """Counters since start, as a worker's `stats` report them (deploy/README.md lists them)."""
        fetched = self.fetcher.stats
        return {
            "prefix_store_lookups": fetched.num_lookups,
            "prefix_store_hits": fetched.num_hits,
            "prefix_store_hit_tokens": fetched.num_hit_tokens,
            "prefix_store_fetch_failures": fetched.num_failures,
            **self.publisher.stats.counters(),
        }

    def close(self) -> None:
        self.publisher.detach(self.loop)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def _client(self, address: str) -> StateStoreClient:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = StateStoreClient(address, timeout_s=LOOKUP_TIMEOUT_S)
            return self._clients[address]
