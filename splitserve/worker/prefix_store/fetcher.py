"""Fetches a prompt's longest stored prefix state from the stores, for a prefill that missed locally.

The stores' prefix indexes name keys holding complete states (written by `PrefixPublisher`);
the fetcher asks each store it knows for the longest match of the request's hash chain (and its
tokens, for states that end inside a unit), streams the longest one in, decodes it into layer
states and checks it is whole before the engine sees it. It runs on the request's own thread,
never the engine's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.state import Chunk, HeadRange, StateKind, checksum
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import CorruptStateError, StateStoreError
from splitserve.state.records import NO_PREFIX_MATCH, PrefixMatch

if TYPE_CHECKING:
    from splitserve.engine.model.kimi_linear import LayerCaches
    from splitserve.engine.prefix_cache.imported import ImportedPrefix
    from splitserve.engine.state_transfer import LayerState

logger = logging.getLogger(__name__)


@dataclass
class FetcherStats:
    """What the fetcher did since it started (counters only grow)."""

    num_lookups: int = 0  # requests the stores were asked about
    num_hits: int = 0  # states imported
    num_hit_tokens: int = 0  # prompt tokens they covered
    num_not_longer: int = 0  # a store held the prefix, but not longer than the local hit by min_gain_tokens
    num_failures: int = 0  # a stored state could not be read or was not whole: computed instead
    fetch_s: float = 0.0  # seconds spent streaming and decoding the hits


@dataclass(frozen=True)
class StoredMatch:
    """A store's longest match of a prompt, and the store holding it."""

    match: PrefixMatch
    store: StateStoreClient


class PrefixFetcher:
    """Finds and streams in the longest stored prefix of a prompt; owns no client (it borrows them).

    Promises: it returns either a whole state (every MLA layer's rows 0..num_tokens and every
    KDA layer's conv and recurrent state, each the shape and dtype of this engine's caches) or
    None. A state a tensor-parallel engine published holds each KDA state as pieces naming their
    heads: every head must be there, and the engine's own `heads` (None: all) of them must fit its
    caches; an engine holding every head gets them assembled, a tensor-parallel rank 0 the pieces
    as stored (each rank takes its own: `ImportedPrefix.for_heads`). Else it returns None; a store that fails, a missing or corrupt piece, or a state of the wrong shape counts a
    failure and returns None, so the request is computed instead, never failed. Thread-safe.
    """

    def __init__(
        self,
        caches: LayerCaches,
        timeout_s: float = 30.0,
        min_gain_tokens: int = 1,
        heads: HeadRange | None = None,
    ) -> None:
        self._heads = heads  # the KDA heads `caches` hold (a tensor-parallel rank's); None: all
        self._mla_layers = sorted(caches.mla_kv)
        self._kda_layers = sorted(caches.kda_conv)
        self._caches = caches
        self.timeout_s = timeout_s
        # A stored state is streamed whole: beyond a local hit it must save at least this many
        # tokens of compute (a prefix unit, from the worker) to be worth reading.
        self.min_gain_tokens = min_gain_tokens
        self.stats = FetcherStats()
        self._lock = threading.Lock()

    def fetch(
        self,
        stores: Sequence[StateStoreClient],
        hash_chain: Sequence[bytes],
        prompt_token_ids: Sequence[int],
        local_hit_tokens: Callable[[], int] = lambda: 0,
    ) -> ImportedPrefix | None:
        """The longest prefix state of the prompt any of `stores` holds, if it covers at least
        `min_gain_tokens` more than `local_hit_tokens()` (what the engine's own cache would serve;
        asked only when a store has a match, so a cold prompt never waits for the engine thread);
        it always leaves the prompt's last token to compute. None when there is no such state or
        it could not be used. `lookup`, `worth_reading` and `read` one at a time."""
        found = self.lookup(stores, hash_chain, prompt_token_ids)
        if found is None or not self.worth_reading(found, local_hit_tokens()):
            return None
        return self.read(found, hash_chain)

    def lookup(
        self, stores: Sequence[StateStoreClient], hash_chain: Sequence[bytes], prompt_token_ids: Sequence[int]
    ) -> StoredMatch | None:
        """The longest match of the prompt (all but its last token) any of `stores` holds, and
        where; None when none holds any (a store that fails is skipped)."""
        if not hash_chain or not stores:
            return None
        usable_tokens = list(prompt_token_ids[:-1])  # the sample needs the last token's logits
        self._count(num_lookups=1)
        best, best_store = NO_PREFIX_MATCH, None
        for store in stores:
            try:
                found = store.match_prefix(hash_chain, usable_tokens)
            except (StateStoreError, ValueError) as exc:
                logger.warning("prefix lookup at %s failed: %s", store.address, exc)
                continue
            if found.key is not None and found.num_tokens > best.num_tokens:
                best, best_store = found, store
        return None if best_store is None else StoredMatch(best, best_store)

    def worth_reading(self, found: StoredMatch, num_local_tokens: int) -> bool:
        """Whether `found` covers at least `min_gain_tokens` more than the engine's own hit of
        `num_local_tokens` (any gain when it has none); counted when not."""
        if found.match.num_tokens - num_local_tokens < (self.min_gain_tokens if num_local_tokens else 1):
            self._count(num_not_longer=1)
            return False
        return True

    def read(self, found: StoredMatch, hash_chain: Sequence[bytes]) -> ImportedPrefix | None:
        """Streams `found` in and checks it is whole; None (counted) when it cannot be used."""
        best, best_store = found.match, found.store
        started = time.monotonic()
        try:
            imported = self._read(best_store, best, hash_chain)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the prompt is computed instead
            self._count(num_failures=1)
            logger.warning(
                "prefix state %r (%d tokens) at %s is unusable, computing instead: %s",
                best.key,
                best.num_tokens,
                best_store.address,
                exc,
            )
            if isinstance(exc, CorruptStateError):  # found here, not by the store: stop it advertising
                with contextlib.suppress(StateStoreError):
                    best_store.release(best.key)
            return None
        self._count(num_hits=1, num_hit_tokens=best.num_tokens, fetch_s=time.monotonic() - started)
        return imported

    def count_failure(self, why: str) -> None:
        """A state this fetcher returned could not be used after all (the prompt is computed)."""
        self._count(num_failures=1)
        logger.warning("a fetched prefix state was not used, computing instead: %s", why)

    def _read(
        self, store: StateStoreClient, found: PrefixMatch, hash_chain: Sequence[bytes]
    ) -> ImportedPrefix:
        # the engine's side (torch), imported where a worker's engine runs (see the package docstring)
        from splitserve.engine.prefix_cache.imported import ImportedPrefix
        from splitserve.engine.state_codec import decode

        assert found.key is not None
        # A chunk read in place from the store's arena is copied, then its checksum is checked on
        # the copy: a retained prefix may be evicted (and its region reused) while it is read.
        copies = []
        for chunk in store.get(found.key, timeout_s=self.timeout_s):
            data = bytes(chunk.data)
            checksum.verify(data, chunk.meta.checksum, f"{chunk.meta.describe()} as copied")
            copies.append(Chunk(chunk.meta, data))
        states = self._check_whole(list(decode(copies)), found)
        return ImportedPrefix(found.num_tokens, list(hash_chain[: found.num_units]), states)

    def _check_whole(self, states: list[LayerState], found: PrefixMatch) -> list[LayerState]:
        """`states` as this engine imports them (see the class); raises `CorruptStateError` unless
        they are exactly a whole prefix state of this engine's model."""
        from splitserve.engine.parallel.heads import check_every_head, take_heads
        from splitserve.engine.state_transfer import cache_for

        expected = {(layer, StateKind.MLA_KV) for layer in self._mla_layers}
        expected |= {
            (layer, kind)
            for layer in self._kda_layers
            for kind in (StateKind.KDA_CONV, StateKind.KDA_RECURRENT)
        }
        got = {(s.layer_id, StateKind(s.kind)) for s in states}
        num_mla = sum(1 for s in states if s.kind is StateKind.MLA_KV)
        if got != expected or num_mla != len(self._mla_layers):
            raise CorruptStateError(
                f"key {found.key!r} holds {len(got)} layer states, this engine needs {len(expected)} "
                f"(missing {sorted(expected - got)[:4]}, unexpected {sorted(got - expected)[:4]})"
            )
        for state in states:
            if state.kind is StateKind.MLA_KV and (state.token_start, state.token_end) != (
                0,
                found.num_tokens,
            ):
                raise CorruptStateError(
                    f"key {found.key!r} layer {state.layer_id} holds KV rows [{state.token_start}, "
                    f"{state.token_end}), its prefix covers [0, {found.num_tokens})"
                )
        named = [s.heads.num_heads for s in states if s.heads is not None]
        num_heads = self._heads.num_heads if self._heads is not None else (named[0] if named else 0)
        if not num_heads:  # whole states (a width-1 publisher) for an engine holding every head
            here = states
        else:
            check_every_head(states, num_heads)
            here = take_heads(states, self._heads or HeadRange(0, num_heads, num_heads))
        for state in here:
            cache_for(self._caches, state)  # ValueError on a shape or dtype this engine does not cache
        partial = self._heads is not None and self._heads.end - self._heads.start < num_heads
        return states if partial else here  # a rank 0's other ranks take theirs from what is stored

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)
