"""Which stored key holds the complete state of which prompt prefix, by chained prefix hashes."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class PrefixIndex:
    """Maps the last hash of a prefix-hash chain to the keys holding that prefix's full state.

    A chain's element i names the whole prompt up to prefix unit i (each hash covers the ones
    before it), so a key registered under chain[:n] answers any query whose element n-1 is equal.
    Registering is the writer's promise that the key holds every MLA layer's KV and a KDA state
    snapshot at exactly that boundary (docs/ARCHITECTURE.md: a prefix hit is all or nothing); the index
    only remembers it. Not thread-safe (the store locks); owns no state bytes.
    """

    def __init__(self) -> None:
        self._keys_by_hash: dict[bytes, list[str]] = {}  # most recently registered last
        self._hashes_by_key: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._keys_by_hash)

    def register(self, hash_chain: Sequence[bytes], key: str) -> int:
        """Records that `key` holds the prefix named by `hash_chain`; returns its length in units."""
        if not hash_chain:
            raise ValueError(f"cannot register key {key!r} under an empty prefix-hash chain")
        last = bytes(hash_chain[-1])
        keys = self._keys_by_hash.setdefault(last, [])
        if key in keys:
            keys.remove(key)
        keys.append(key)
        self._hashes_by_key.setdefault(key, set()).add(last)
        return len(hash_chain)

    def longest_match(
        self, hash_chain: Sequence[bytes], usable: Callable[[str], bool]
    ) -> tuple[int, str | None]:
        """(units, key) of the longest registered prefix of `hash_chain` whose key is `usable`;
        (0, None) when there is none. Among keys for one prefix the latest registered wins."""
        for num_units in range(len(hash_chain), 0, -1):
            for key in reversed(self._keys_by_hash.get(bytes(hash_chain[num_units - 1]), ())):
                if usable(key):
                    return num_units, key
        return 0, None

    def forget(self, key: str) -> None:
        """Drops every registration of `key` (it was released, expired or evicted)."""
        for digest in self._hashes_by_key.pop(key, ()):
            keys = self._keys_by_hash[digest]
            keys.remove(key)
            if not keys:
                del self._keys_by_hash[digest]
