"""The router's approximate map of which prefill worker holds which prompt prefixes.

Two sources feed it: the gateway's own record of where it sent which chain (usable at once,
before any worker reports), and the events each worker's engine publishes when a prefix unit
becomes a usable hit there or stops being one (`Prefill.CacheReport`). It is approximate by
design: a wrong guess costs a recompute (or a fetch from the store), never a wrong answer,
because the engine checks every hit itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_MAX_ENTRIES = 200_000  # prefix units; ~100 B each with their holders: ~20 MiB at most


@dataclass(frozen=True)
class CacheEvent:
    """A worker's prefix unit became a usable hit (`stored`) or stopped being one."""

    stored: bool
    block_hash: bytes
    num_tokens: int


class PrefixIndex:
    """Owns a bounded LRU of prefix hashes, each with the workers believed to hold it and the
    number of prompt tokens it names there.

    Not thread-safe: its router's lock guards it. Bounded to `max_entries` hashes; the least
    recently sent, reported or matched goes first. A worker's entries go when it leaves the
    pool or reports a new engine instance (a restart at the same address starts empty).
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"a prefix index needs room for at least 1 entry (got {max_entries})")
        self.max_entries = max_entries
        self._holders: OrderedDict[bytes, dict[str, int]] = OrderedDict()
        self._instances: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def record_sent(self, address: str, chain: Sequence[bytes], unit: int) -> None:
        """`address` was sent a prompt with this chain: it will hold its units once it ran it."""
        for i, block_hash in enumerate(chain):
            self._add(block_hash, address, (i + 1) * unit)

    def apply(self, address: str, events: Iterable[CacheEvent]) -> None:
        for event in events:
            if event.stored:
                self._add(event.block_hash, address, event.num_tokens)
            else:
                self._remove(event.block_hash, address)

    def observe_instance(self, address: str, instance_id: str) -> None:
        """The engine behind `address` is `instance_id`; a different one than before holds nothing."""
        previous = self._instances.get(address)
        if previous is not None and previous != instance_id:
            self.forget(address)
        self._instances[address] = instance_id

    def keep_only(self, addresses: Iterable[str]) -> None:
        """Drop every worker not in `addresses` (it left the pool)."""
        keep = set(addresses)
        gone = {a for holders in self._holders.values() for a in holders} - keep
        gone |= set(self._instances) - keep
        for address in gone:
            self.forget(address)

    def match(self, chain: Sequence[bytes]) -> dict[str, int]:
        """Prompt tokens each worker is believed to hold of the prefix `chain` names.

        The longest unit a worker holds counts: a chain hash names everything before it."""
        matched: dict[str, int] = {}
        for block_hash in reversed(chain):
            holders = self._holders.get(block_hash)
            if holders is None:
                continue
            self._holders.move_to_end(block_hash)
            for address, num_tokens in holders.items():
                matched.setdefault(address, num_tokens)
        return matched

    def _add(self, block_hash: bytes, address: str, num_tokens: int) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            holders = self._holders[block_hash] = {}
            while len(self._holders) > self.max_entries:
                self._holders.popitem(last=False)
        else:
            self._holders.move_to_end(block_hash)
        holders[address] = num_tokens

    def _remove(self, block_hash: bytes, address: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.pop(address, None)
            if not holders:
                del self._holders[block_hash]

    def forget(self, address: str) -> None:
        """Believe `address` holds nothing (a snapshot of it follows, or it left)."""
        self._instances.pop(address, None)
        for block_hash in [h for h, holders in self._holders.items() if address in holders]:
            self._remove(block_hash, address)
