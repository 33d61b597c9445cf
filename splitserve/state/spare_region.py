"""A writer's region leased ahead: the `Allocate` round trip of its next put, done after this one.

Profiled at 16 MiB on the 2-core dev box, a put's first region cost 1-1.5 ms of a 6 ms handoff
just to start its `Allocate` call (Python gRPC), then a wait for the reply before the first
copy. A client made with `spare_region=True` leases one region ahead under a spare key (the
store's `SPARE_PREFIX`, owned by the writer, its own lease) when a put finishes; the next put of
about that size (the size up to twice what it needs) starts copying into it at once, and its
first commit moves the region to the put's key (the store's `_adopt_spare_locked`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from splitserve.state.shm import SPARE_PREFIX, LocalArena

SPARE_LEASE_S = 300.0  # a spare's lease in the store; a writer uses it only in the first half


@dataclass(frozen=True)
class _Lease:
    key: str
    num_bytes: int
    owner: str
    arena: LocalArena  # the arena it was leased in: a restarted store's regions are others
    reply: grpc.Future  # the Allocate call's: its `region` names the spare
    use_by_s: float  # time.monotonic() after which it is left to expire


class SpareRegion:
    """At most one region leased ahead for one client, and the rules for handing it out.

    `take` never waits: a spare whose Allocate has not answered, that is too old, of another
    owner or arena, or the wrong size is not used (a put then allocates as before). `refill`
    starts the next lease (one Allocate call, not waited for) and gives up a mismatched spare
    (one Release call, not waited for). `forget` drops it after an owner-wide release, which
    freed it in the store. Thread-safe.
    """

    def __init__(
        self,
        allocate: Callable[[str, int, str, float], grpc.Future],
        release: Callable[[str], grpc.Future],
    ) -> None:
        self._allocate, self._release = allocate, release
        self._lock = threading.Lock()
        self._lease: _Lease | None = None
        self._releasing: list[grpc.Future] = []  # Release calls in flight: a dropped future cancels its call

    def take(self, num_bytes: int, owner: str, arena: LocalArena) -> Callable[[], str] | None:
        """The spare's name (as a `first_region` callable) if it fits a put of `num_bytes` by
        `owner` in `arena` now; None otherwise. A spare handed out is never handed out again."""
        with self._lock:
            lease = self._lease
            if lease is None or not self._fits(lease, num_bytes, owner, arena) or not lease.reply.done():
                return None
            self._lease = None
        try:
            name: str = lease.reply.result().region
        except grpc.RpcError:  # the store could not lease it: allocate as before
            return None
        return lambda: name

    def refill(self, num_bytes: int, owner: str, arena: LocalArena) -> None:
        """Leases a spare of `num_bytes` for `owner` unless one that fits is held or coming."""
        with self._lock:
            old = self._lease
            if old is not None and self._fits(old, num_bytes, owner, arena):
                return
            key = f"{SPARE_PREFIX}{owner}/{uuid.uuid4().hex}"
            self._lease = _Lease(
                key,
                num_bytes,
                owner,
                arena,
                self._allocate(key, num_bytes, owner, SPARE_LEASE_S),
                time.monotonic() + SPARE_LEASE_S / 2,
            )
        if old is not None:
            released = self._release(old.key)
            with self._lock:
                self._releasing = [call for call in self._releasing if not call.done()]
                self._releasing.append(released)

    def wait(self, timeout_s: float) -> str | None:
        """The spare's region name once its lease is answered (tests, warm-ups), None if none
        is held. Raises the Allocate call's `grpc.RpcError`."""
        with self._lock:
            lease = self._lease
        return None if lease is None else str(lease.reply.result(timeout=timeout_s).region)

    def forget(self) -> None:
        with self._lock:
            self._lease = None

    @staticmethod
    def _fits(lease: _Lease, num_bytes: int, owner: str, arena: LocalArena) -> bool:
        return (
            lease.owner == owner
            and lease.arena is arena
            and num_bytes <= lease.num_bytes <= 2 * num_bytes
            and time.monotonic() < lease.use_by_s
        )
