"""The prefix-aware policy (the default): send a prompt where its prefix is already cached,
unless that worker's queue costs more than the recompute it saves."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from frontend.prefix_index import DEFAULT_MAX_ENTRIES, CacheEvent, PrefixIndex
from frontend.router import LeastLoadRouter


class PrefixAwareRouter(LeastLoadRouter):
    """Prefill: the worker with the lowest cost, in prompt tokens: what this gateway already has
    outstanding there plus the tokens of this prompt it would compute (the prompt less the
    prefix the index says it holds). So a worker holding the prefix wins until its queue
    outweighs the prefix; with no match anywhere this is least-load. Ties rotate.

    Decode: as least-load (a worker on the prefill's node first when its load allows), except that a colocated worker (one in both pools, where the decode
    choice also runs the prefill) with room is ranked by the same prefill cost first.

    Owns a `PrefixIndex` (bounded, approximate), fed by `on_prefix_sent` and the workers' cache
    events; a worker leaving the prefill pool is dropped from it. A second one, `decode_index`,
    holds the request ends the decode workers keep when a request finishes (for local prefill:
    `router.local_prefill_max_tokens`); a worker that refuses a local prefill loses the entries
    of that prompt's chain, one leaving the decode pool all of its own.
    """

    def __init__(
        self,
        prefill_addresses: Sequence[str] = (),
        decode_addresses: Sequence[str] = (),
        *,
        prefix_unit: int,
        max_index_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        if prefix_unit < 1:
            raise ValueError(f"prefix_unit must be at least 1 token (got {prefix_unit})")
        self.prefix_unit = prefix_unit
        self.index = PrefixIndex(max_index_entries)
        self.decode_index = PrefixIndex(max_index_entries)
        super().__init__(prefill_addresses, decode_addresses)

    def update_workers(self, prefill_addresses: Sequence[str], decode_addresses: Sequence[str]) -> None:
        super().update_workers(prefill_addresses, decode_addresses)
        with self._lock:
            self.index.keep_only(self._prefill)
            self.decode_index.keep_only(self._decode)

    def pick_prefill(
        self, num_prompt_tokens: int, prefix_hashes: Sequence[bytes] = (), exclude: Collection[str] = ()
    ) -> str | None:
        with self._lock:
            candidates = self._prefill_rotation(exclude)
            if not candidates:
                return None
            matched = self.index.match(prefix_hashes)
            return min(candidates, key=lambda a: self._cost(a, num_prompt_tokens, matched))

    def rank_decode(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        prefix_hashes: Sequence[bytes] = (),
        near: str | None = None,
    ) -> list[str]:
        with self._lock:
            order = self._decode_rotation()
            colocated = [a for a in order if a in self._outstanding]
            if not prefix_hashes or not colocated:
                return self._near_first(sorted(order, key=self._decode_key), near)
            matched = self.index.match(prefix_hashes)

            def key(address: str) -> tuple[int, int, float]:
                room, free = self._decode_key(address)
                return room, self._cost(address, num_prompt_tokens, matched), free

            return sorted(order, key=key)

    def _cost(self, address: str, num_prompt_tokens: int, matched: dict[str, int]) -> int:
        """Prompt tokens `address` would have to get through before this prompt's first token."""
        num_cached = min(matched.get(address, 0), num_prompt_tokens)
        return self._outstanding.get(address, 0) + num_prompt_tokens - num_cached

    def on_prefix_sent(self, address: str, prefix_hashes: Sequence[bytes]) -> None:
        with self._lock:
            if address in self._outstanding:
                self.index.record_sent(address, prefix_hashes, self.prefix_unit)

    def observe_cache_events(
        self, address: str, instance_id: str, events: Sequence[CacheEvent], snapshot: bool = False
    ) -> None:
        with self._lock:
            if address not in self._outstanding:
                return  # not (or no longer) a prefill worker: nothing to route by
            if snapshot:
                self.index.forget(address)
            self.index.observe_instance(address, instance_id)
            self.index.apply(address, events)

    def decode_prefix_match(self, prefix_hashes: Sequence[bytes]) -> dict[str, int]:
        with self._lock:
            return self.decode_index.match(prefix_hashes) if prefix_hashes else {}

    def on_decode_retained(self, address: str, block_hash: bytes, num_tokens: int) -> None:
        with self._lock:
            if address in self._reserved_since_stats:  # still in the decode pool
                self.decode_index.apply(address, [CacheEvent(True, block_hash, num_tokens)])

    def on_local_prefill_refused(self, address: str, prefix_hashes: Sequence[bytes]) -> None:
        with self._lock:
            self.decode_index.apply(address, [CacheEvent(False, h, 0) for h in prefix_hashes])
