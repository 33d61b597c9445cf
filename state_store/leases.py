"""Leases: every stored key has an owner and a deadline; a key past its deadline is expired."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass
class Lease:
    owner: str
    deadline: float  # in the table's clock


class LeaseTable:
    """Owners and deadlines of keys, indexed by owner and by deadline; not thread-safe.

    Owns no state bytes: the store asks it which keys expired (`pop_expired`) and which keys an
    owner holds (`keys_of`), then frees them itself. The clock is injectable (defaults to
    `time.monotonic`) so tests move time instead of sleeping.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._by_owner: dict[str, set[str]] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries skipped lazily

    def __contains__(self, key: str) -> bool:
        return key in self._leases

    def get(self, key: str) -> Lease | None:
        return self._leases.get(key)

    def grant(self, key: str, owner: str, lease_s: float) -> Lease:
        """Gives `key` to `owner` until now + lease_s (replacing any earlier lease)."""
        if not owner:
            raise ValueError(f"key {key!r} needs an owner: every stored object has one")
        self.drop(key)
        lease = Lease(owner, self._deadline(lease_s))
        self._leases[key] = lease
        self._by_owner.setdefault(owner, set()).add(key)
        heapq.heappush(self._deadlines, (lease.deadline, key))
        return lease

    def renew(self, key: str, lease_s: float) -> Lease:
        """Moves `key`'s deadline to now + lease_s; KeyError if it holds no lease."""
        lease = self._leases[key]
        lease.deadline = self._deadline(lease_s)
        if lease.deadline != math.inf:  # never due (a retained prefix): kept out of the heap for good
            heapq.heappush(self._deadlines, (lease.deadline, key))
        return lease

    def remaining_s(self, key: str) -> float:
        return self._leases[key].deadline - self.clock()

    def drop(self, key: str) -> None:
        lease = self._leases.pop(key, None)
        if lease is not None:
            keys = self._by_owner[lease.owner]
            keys.discard(key)
            if not keys:
                del self._by_owner[lease.owner]

    def keys_of(self, owner: str) -> list[str]:
        return sorted(self._by_owner.get(owner, ()))

    def pop_expired(self) -> list[str]:
        """Keys whose deadline has passed, dropped from the table, oldest deadline first."""
        now = self.clock()
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, key = heapq.heappop(self._deadlines)
            lease = self._leases.get(key)
            if lease is not None and lease.deadline == deadline:
                self.drop(key)
                expired.append(key)
        return expired

    def _deadline(self, lease_s: float) -> float:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0 seconds (got {lease_s})")
        return self.clock() + lease_s
