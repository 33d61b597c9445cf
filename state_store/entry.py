"""One stored key's bookkeeping inside the store: its chunks' metadata, seal, pins, waiters."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from splitserve.state.chunk import ChunkId, ChunkMeta
from splitserve.state.errors import StateStoreError, StateTimeoutError
from state_store.arena import Region

Gone = tuple[type[StateStoreError], str]


class Entry:
    """One key's chunks (metadata only: the bytes live in the tiers or in arena regions), seal
    flag, pins, waiters.

    Not thread-safe: the store holds its lock (the one `cond` is built on) around every use.
    `gone` is set, and the waiters woken, when the store drops the key.
    """

    def __init__(self, key: str, owner: str, lock: threading.Lock) -> None:
        self.key = key
        self.owner = owner
        self.cond = threading.Condition(lock)
        self.metas: dict[ChunkId, ChunkMeta] = {}
        self.order: list[ChunkId] = []
        self.sealed = False
        self.num_bytes = 0
        self.num_pins = 0
        self.gone: Gone | None = None
        # Read-only outside this class: `add`, `discard`, `add_region` and `pop_region` change
        # them and keep `held_bytes` in step.
        self.regions: dict[str, Region] = {}  # arena regions allocated to this key, by name
        self.locations: dict[ChunkId, tuple[Region, int]] = {}  # chunks committed in a region: where
        self._held_bytes = 0
        # Told the new `held_bytes` on every change (the retained prefixes keep a running total).
        self.on_held_bytes: Callable[[int], object] | None = None

    @property
    def held_bytes(self) -> int:
        """What the key occupies in the tiers: chunks outside regions plus whole arena regions
        (a region is sized before it is filled, so it may be larger than the chunks in it).
        Kept as chunks and regions come and go, so reading it costs nothing."""
        return self._held_bytes

    def count_held_bytes(self) -> int:
        """`held_bytes` counted from scratch (O(chunks); tests check the running count with it)."""
        loose = sum(meta.num_bytes for cid, meta in self.metas.items() if cid not in self.locations)
        return loose + sum(region.num_bytes for region in self.regions.values())

    def add(self, meta: ChunkMeta, place: tuple[Region, int] | None = None) -> None:
        """Records a chunk: put as bytes (held in the tiers), or committed in one of this key's
        regions at `place` (its bytes are the region's, already held)."""
        self.metas[meta.id] = meta
        self.order.append(meta.id)
        self.num_bytes += meta.num_bytes
        if place is not None:
            self.locations[meta.id] = place
        else:
            self._hold(meta.num_bytes)

    def discard(self, meta: ChunkMeta) -> None:
        del self.metas[meta.id]
        self.order.remove(meta.id)
        self.num_bytes -= meta.num_bytes
        if self.locations.pop(meta.id, None) is None:
            self._hold(-meta.num_bytes)

    def add_region(self, region: Region) -> None:
        """An arena region now belongs to this key (held whole, filled or not)."""
        previous = self.regions.get(region.name)
        self.regions[region.name] = region
        self._hold(region.num_bytes - (previous.num_bytes if previous is not None else 0))

    def pop_region(self, name: str) -> Region:
        """Takes region `name` away from this key (KeyError if it has none of that name)."""
        region = self.regions.pop(name)
        self._hold(-region.num_bytes)
        return region

    def _hold(self, delta_bytes: int) -> None:
        self._held_bytes += delta_bytes
        if self.on_held_bytes is not None:
            self.on_held_bytes(self._held_bytes)

    def raise_if_gone(self) -> None:
        if self.gone is not None:
            cls, why = self.gone
            raise cls(why)

    def wait_for_chunk(
        self,
        position: int,
        deadline: float | None,
        cancel: threading.Event | None,
        on_wake: Callable[[], object],
    ) -> bool:
        """Waits (lock held) until chunk number `position` exists or the key is sealed.

        False if `cancel` got set; raises the key's error if it went away, `StateTimeoutError` at
        `deadline` (time.monotonic). `on_wake` runs after each wake-up (the store expires leases).
        """
        while position >= len(self.order) and not self.sealed:
            if cancel is not None and cancel.is_set():
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise StateTimeoutError(
                    f"key {self.key!r} was not sealed in time ({position} chunks arrived); "
                    "is its writer still running?"
                )
            self.cond.wait(remaining)
            if self.gone is None:
                on_wake()
            self.raise_if_gone()
        return True


class Tombstones:
    """Why recently gone keys went (bounded, oldest forgotten first), so late callers learn why."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._gone: OrderedDict[str, Gone] = OrderedDict()

    def add(self, key: str, gone: Gone) -> None:
        self._gone[key] = gone
        while len(self._gone) > self.capacity:
            self._gone.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        return key in self._gone

    def raise_if_gone(self, key: str, suffix: str = "") -> None:
        if key in self._gone:
            cls, why = self._gone[key]
            raise cls(why + suffix)
