"""The prefix-cache half of the store: its prefix index and the retained prefixes it keeps.

A mixin of `StateStore` (state_store/store.py), kept apart so each file holds one concept; it
uses the store's lock, entries, leases and tiers under the store's rules (the *_locked helpers).
A registered key is retained: it loses its lease expiry and stays until the retained prefixes
outgrow their budget, the tiers need its room, it is released, or a piece of it reads corrupt;
dropping it (`_drop_locked`) forgets it in the index, so what is advertised only shortens.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from splitserve.state.chunk import ChunkId
from splitserve.state.errors import StoreFullError
from splitserve.state.records import PrefixMatch, StoreStats

if TYPE_CHECKING:
    from state_store.entry import Entry
    from state_store.leases import LeaseTable
    from state_store.prefix_index import PrefixIndex
    from state_store.retained import RetainedPrefixes
    from state_store.tiered import RegionId, TieredStorage


class PrefixCatalog:
    """`register` and `match_prefix` (`longest_match`): which sealed keys hold which prompt
    prefixes, and `_tier_put_locked`: state in flight takes room from retained prefixes first."""

    if TYPE_CHECKING:
        _lock: threading.Lock
        _leases: LeaseTable
        _prefixes: PrefixIndex
        _retained: RetainedPrefixes
        _stats: StoreStats
        _tiers: TieredStorage

        def _expire_locked(self) -> int: ...
        def _live_locked(self, key: str) -> Entry: ...
        def _is_sealed_locked(self, key: str) -> bool: ...
        def _evict_locked(self, key: str, why: str) -> None: ...

    def register(
        self,
        hash_chain: Sequence[bytes],
        key: str,
        *,
        tail_token_ids: Sequence[int] = (),
        num_tokens: int = 0,
    ) -> None:
        """Records that `key` holds the complete state of the prefix named by `hash_chain` (and
        `tail_token_ids` past its last unit; `num_tokens` in all) and retains the key: no lease
        expiry from now on (see the class docstring for what ends it)."""
        with self._lock:
            self._expire_locked()
            entry = self._live_locked(key)
            self._prefixes.register(hash_chain, key, tail_token_ids, num_tokens)
            if key not in self._retained:
                self._leases.renew(key, math.inf)
                self._retained.add(key, entry.held_bytes)
                # a key registered before it is sealed keeps growing: the running total follows
                entry.on_held_bytes = functools.partial(self._retained.resize, key)
            for victim in self._retained.over_budget():
                self._evict_locked(victim, "the retained prefixes outgrew the store's prefix_budget_bytes")

    def longest_match(self, hash_chain: Sequence[bytes]) -> tuple[int, str | None]:
        """(units, key) of the longest registered, sealed prefix of `hash_chain` ending on a unit
        boundary; (0, None) if none (`match_prefix` also says how many tokens)."""
        found = self.match_prefix(hash_chain)
        return found.num_units, found.key

    def match_prefix(
        self, hash_chain: Sequence[bytes], token_ids: Sequence[int] | None = None
    ) -> PrefixMatch:
        """(units, key, tokens) of the longest registered, sealed prefix of `hash_chain` (whose
        tail, if it ends inside a unit, continues `token_ids`); (0, None, 0) if none."""
        with self._lock:
            self._expire_locked()
            found = self._prefixes.longest_match(hash_chain, self._is_sealed_locked, token_ids)
            self._stats.num_prefix_lookups += 1
            if found.key is not None:
                self._stats.num_prefix_hits += 1
                self._stats.num_prefix_hit_tokens += found.num_tokens
                self._retained.touch(found.key)
            return found

    def _tier_put_locked(
        self, key: str, oid: ChunkId | RegionId, data: bytes | memoryview, **kwargs: bool
    ) -> list[tuple[str, str]]:
        """`TieredStorage.put` for `key`; when the tiers cannot make room (pinned regions), the
        retained prefixes give way, least recently hit first: state in flight goes before them."""
        while True:
            try:
                return self._tiers.put(oid, data, **kwargs)
            except StoreFullError:
                victim = self._retained.oldest(excluding=key)
                if victim is None:
                    raise
                self._evict_locked(victim, "its room was needed for state in flight")
