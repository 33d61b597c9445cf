"""Which stored key holds the complete state of which prompt prefix, by chained prefix hashes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.state.records import NO_PREFIX_MATCH, PrefixMatch


@dataclass(frozen=True)
class _Registration:
    key: str
    tail: tuple[int, ...]  # tokens past the last whole unit
    num_tokens: int  # tokens the state covers (0: unknown, whole units only)

    def matches(self, token_ids: Sequence[int] | None) -> bool:
        """Whether a query whose chain agrees on this entry's units also agrees on its tail
        (and, given its tokens, is at least as long)."""
        if token_ids is None:
            return not self.tail
        if self.num_tokens and self.num_tokens > len(token_ids):
            return False
        start = self.num_tokens - len(self.tail)
        return not self.tail or tuple(token_ids[start : self.num_tokens]) == self.tail


class PrefixIndex:
    """Maps the last hash of a prefix-hash chain to the keys holding that prefix's full state.

    A chain's element i names the whole prompt up to prefix unit i (each hash covers the ones
    before it), so a key registered under chain[:n] answers any query whose element n-1 is equal.
    A state that ends inside a unit (a prompt's end) is registered under its whole units plus
    its tail tokens, and answers only queries whose tokens continue with that tail.
    Registering is the writer's promise that the key holds every MLA layer's KV and a KDA state
    snapshot at exactly that boundary (docs/ARCHITECTURE.md: a prefix hit is all or nothing); the index
    only remembers it. Not thread-safe (the store locks); owns no state bytes.
    """

    def __init__(self) -> None:
        # per last hash, its registrations by key, most recently registered last (a dict, so
        # registering again and forgetting cost O(1), not O(registrations of that hash))
        self._by_hash: dict[bytes, dict[str, _Registration]] = {}
        self._hashes_by_key: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, key: str) -> bool:
        return key in self._hashes_by_key

    def register(
        self, chain: Sequence[bytes], key: str, tail: Sequence[int] = (), num_tokens: int = 0
    ) -> int:
        """Records that `key` holds the prefix named by `chain` (+ `tail`, the tokens past its last
        whole unit, with `num_tokens` in all); returns its length in units."""
        if not chain:
            raise ValueError(f"cannot register key {key!r} under an empty prefix-hash chain")
        tail = tuple(int(t) for t in tail)
        if tail and num_tokens <= len(tail):
            raise ValueError(
                f"key {key!r}: a tail of {len(tail)} tokens needs num_tokens (got {num_tokens}) to "
                "say where it starts"
            )
        last = bytes(chain[-1])
        entries = self._by_hash.setdefault(last, {})
        entries.pop(key, None)
        entries[key] = _Registration(key, tail, num_tokens)
        self._hashes_by_key.setdefault(key, set()).add(last)
        return len(chain)

    def longest_match(
        self,
        hash_chain: Sequence[bytes],
        usable: Callable[[str], bool],
        token_ids: Sequence[int] | None = None,
    ) -> PrefixMatch:
        """The longest registered prefix of `hash_chain` (and `token_ids`, if given) whose key is
        `usable`. Among keys for one prefix the one covering most tokens wins, then the latest."""
        for num_units in range(len(hash_chain), 0, -1):
            best: _Registration | None = None
            for entry in reversed(self._by_hash.get(bytes(hash_chain[num_units - 1]), {}).values()):
                better = best is None or entry.num_tokens > best.num_tokens
                if better and entry.matches(token_ids) and usable(entry.key):
                    best = entry
            if best is not None:
                return PrefixMatch(num_units, best.key, best.num_tokens)
        return NO_PREFIX_MATCH

    def forget(self, key: str) -> None:
        """Drops every registration of `key` (it was released, expired, evicted or corrupt)."""
        for digest in self._hashes_by_key.pop(key, ()):
            entries = self._by_hash[digest]
            del entries[key]
            if not entries:
                del self._by_hash[digest]
