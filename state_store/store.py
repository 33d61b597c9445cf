"""The state store's core: leased, checksummed chunks by key over a RAM tier that spills to disk."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterator

from splitserve.state import checksum
from splitserve.state.chunk import MAX_CHUNK_BYTES, Chunk, ChunkMeta
from splitserve.state.errors import (
    CorruptStateError,
    InvalidChunkError,
    KeySealedError,
    LeaseExpiredError,
    OwnershipError,
    StateEvictedError,
    StateNotFoundError,
    StateReleasedError,
    StateStoreError,
    StateTimeoutError,
    StoreFullError,
)
from splitserve.state.records import KeyInfo, ReleaseResult, StoreStats
from state_store.arena import Arena
from state_store.config import StoreConfig
from state_store.disk_tier import DiskTier
from state_store.entry import Entry, Tombstones
from state_store.leases import Clock, LeaseTable
from state_store.memory_tier import MemoryTier
from state_store.polled_reads import PolledReads
from state_store.prefix_catalog import PrefixCatalog
from state_store.prefix_index import PrefixIndex
from state_store.region_writes import RegionWrites
from state_store.retained import RetainedPrefixes
from state_store.tier import Tier
from state_store.tiered import RegionId, TieredStorage


class StateStore(RegionWrites, PolledReads, PrefixCatalog):
    """Owns every chunk put into it until its key is released, expires, is evicted or corrupts.

    Promises:
    * A read returns exactly the bytes written (checksum checked on put and on every read) or
      raises: `CorruptStateError` on a mismatch, a `StateUnavailableError` subclass saying why a
      key is not there (never stored, lease expired, evicted, released). A key loses all of its
      chunks at once, so no partial state is ever served.
    * `get` streams a key's chunks in arrival order while the writer is still putting them and
      ends when the key is sealed (`final=True` or `seal`) and every chunk was yielded.
    * Chunks go to the memory tier; what it evicts spills to the disk tier; what the disk tier
      evicts takes its whole key with it. Pinned keys are never evicted.
    * Every key has an owner and a lease; expiry is checked on every call and by `expire()`.
    * A key registered in the prefix index (a retained prefix) loses its lease: it stays until
      the tiers evict it, the retained prefixes outgrow `prefix_budget_bytes` or state in flight
      needs their room (least recently hit first), it is released, or a piece of it reads
      corrupt; then the index forgets it (`PrefixCatalog`).
    * With an `arena`, a writer on the node may `allocate` a shared-memory region for a key, fill
      it, and `put_region` its chunks: their bytes stay in the region (counted and pinned in the
      memory tier) until the key goes, and are checksum-verified by whoever reads them.
    Thread-safe: one lock guards the metadata; chunk bytes are read and checked outside it.
    """

    def __init__(
        self,
        memory: Tier,
        disk: Tier | None = None,
        *,
        default_lease_s: float = 60.0,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        clock: Clock = time.monotonic,
        num_tombstones: int = 65536,
        arena: Arena | None = None,
        prefix_budget_bytes: int | None = None,
    ) -> None:
        self._tiers = TieredStorage(memory, disk)
        self.arena = arena
        self.default_lease_s = default_lease_s
        self.max_chunk_bytes = max_chunk_bytes
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._key_created = threading.Condition(self._lock)  # readers waiting for a first put
        self._leases = LeaseTable(clock)
        self._prefixes = PrefixIndex()
        self._retained = RetainedPrefixes(prefix_budget_bytes)
        self._tombstones = Tombstones(num_tombstones)
        self._stats = StoreStats()
        self._closed = False
        self._watchers: dict[str, set[Callable[[], object]]] = {}  # async readers (`watch`)
        self._spare_regions: dict[str, str] = {}  # region name -> the spare key holding it (RegionWrites)

    @classmethod
    def from_config(cls, config: StoreConfig, *, clock: Clock = time.monotonic) -> StateStore:
        disk = DiskTier(config.disk_path, config.disk_bytes) if config.disk_path else None
        return cls(
            MemoryTier(config.memory_bytes),
            disk,
            default_lease_s=config.default_lease_s,
            max_chunk_bytes=config.max_chunk_bytes,
            clock=clock,
            num_tombstones=config.num_tombstones,
            arena=Arena.open_default(config.arena_root, config.arena_pool_bytes, config.transfer_engine),
            prefix_budget_bytes=config.prefix_budget_bytes,
        )

    # ---- writes ---------------------------------------------------------------------------

    def put(self, chunk: Chunk, *, owner: str, lease_s: float | None = None, final: bool = False) -> None:
        """Stores one chunk under its key, creating the key (owned by `owner`) if it is new.

        `lease_s` sets the key's lease to now + lease_s (on creation the default applies if None);
        `final` seals the key after this chunk.
        """
        meta = chunk.meta
        if len(chunk.data) > self.max_chunk_bytes:
            raise InvalidChunkError(
                f"{meta.describe()} is {len(chunk.data)} bytes, over the store's {self.max_chunk_bytes}; "
                "split it with splitserve.state.make_chunks"
            )
        try:
            checksum.verify(chunk.data, meta.checksum, f"{meta.describe()} as received")
        except CorruptStateError:
            with self._lock:
                self._stats.num_corruptions += 1
            raise
        with self._lock:
            if self._closed:
                raise StateReleasedError("the state store is closed")
            self._expire_locked()
            entry = self._writable_locked(meta.key, owner, lease_s)
            if meta.id in entry.metas:
                raise KeySealedError(f"{meta.describe()} was already stored; chunks are written once")
            entry.add(meta)
            try:
                self._place_locked(entry, meta, chunk.data)
            except StoreFullError:
                if entry.gone is None:
                    entry.discard(meta)
                raise
            entry.raise_if_gone()  # its own write made room by evicting it
            entry.sealed = final
            entry.cond.notify_all()
            self._notify_locked(meta.key)

    def seal(self, key: str, *, owner: str) -> None:
        """Marks `key` complete: readers stop after its last chunk. Idempotent."""
        with self._lock:
            self._expire_locked()
            entry = self._live_locked(key)
            if entry.owner != owner:
                raise OwnershipError(f"key {key!r} belongs to {entry.owner!r}; {owner!r} may not seal it")
            entry.sealed = True
            entry.cond.notify_all()
            self._notify_locked(key)

    # ---- reads ----------------------------------------------------------------------------

    def get(
        self,
        key: str,
        *,
        layers: Collection[int] | None = None,
        timeout_s: float | None = None,
        cancel: threading.Event | None = None,
        wait_for_key: bool = False,
    ) -> Iterator[Chunk]:
        """Yields `key`'s chunks (of `layers`, if given) in arrival order as they land.

        Ends once the key is sealed and all were yielded, or quietly when `cancel` is set (call
        `wake(key)` after setting it). Raises `StateTimeoutError` if the key is not sealed within
        `timeout_s` (real seconds), and the key's error if it goes away meanwhile. A key nobody
        has put yet raises `StateNotFoundError`, or with `wait_for_key` is waited for (a reader
        that starts before its writer; a key already gone still raises why at once).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s  # real time, not leases'
        wanted = None if layers is None else set(layers)
        position = 0
        while True:
            with self._lock:
                self._expire_locked()
                waited = self._wait_for_entry_locked(key, deadline, cancel) if wait_for_key else None
                if wait_for_key and waited is None:
                    return  # cancelled before the first put
                entry = waited if waited is not None else self._live_locked(key)
                if not entry.wait_for_chunk(position, deadline, cancel, on_wake=self._expire_locked):
                    return
                if position >= len(entry.order):
                    return
                meta = entry.metas[entry.order[position]]
                position += 1
            if wanted is None or meta.layer in wanted:
                yield Chunk(meta, self._read(entry, meta))

    def wake(self, key: str) -> None:
        """Wakes readers waiting on `key` (so they notice their `cancel` event)."""
        with self._lock:
            self._key_created.notify_all()
            entry = self._entries.get(key)
            if entry is not None:
                entry.cond.notify_all()

    def lookup(self, key: str) -> KeyInfo | None:
        """What `key` holds now, or None if it is not stored (any more)."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(key)
            if entry is None:
                self._stats.num_misses += 1
                return None
            return KeyInfo(
                key,
                entry.owner,
                entry.sealed,
                entry.num_bytes,
                self._leases.remaining_s(key),
                tuple(entry.metas[cid] for cid in entry.order),
            )

    # ---- lifetime -------------------------------------------------------------------------

    def renew(self, key: str, lease_s: float, owner: str = "") -> float:
        """Extends `key`'s lease to now + lease_s (handing it to `owner`, if given); returns the
        seconds it has left."""
        with self._lock:
            self._expire_locked()
            self._live_locked(key)
            if owner:
                self._leases.grant(key, owner, lease_s)
            else:
                self._leases.renew(key, lease_s)
            return self._leases.remaining_s(key)

    def pin(self, key: str) -> None:
        """Keeps `key`'s chunks (present and future) from eviction until `unpin`. Counts."""
        with self._lock:
            entry = self._live_locked(key)
            entry.num_pins += 1
            if entry.num_pins == 1:
                for cid in entry.order:
                    self._tiers.tier_of(cid).pin(cid)

    def unpin(self, key: str) -> None:
        with self._lock:
            entry = self._live_locked(key)
            if entry.num_pins == 0:
                raise ValueError(f"key {key!r} is not pinned")
            entry.num_pins -= 1
            if entry.num_pins == 0:
                for cid in entry.order:
                    self._tiers.tier_of(cid).unpin(cid)

    def release(self, key: str | None = None, *, owner: str | None = None) -> ReleaseResult:
        """Frees `key`, or every key `owner` holds; unknown keys free nothing (idempotent)."""
        if (key is None) == (owner is None):
            raise ValueError("release takes exactly one of key= or owner=")
        with self._lock:
            self._expire_locked()
            keys = [key] if key is not None else self._leases.keys_of(owner or "")
            how = f"by owner {owner!r}" if owner is not None else "by key"
            num_keys = num_bytes = 0
            for name in keys:
                entry = self._entries.get(name)
                if entry is not None:
                    num_bytes += self._drop_locked(
                        entry, StateReleasedError, f"key {name!r} was released {how}"
                    )
                    num_keys += 1
                elif key is not None and name not in self._tombstones:
                    # Released before its first write (a writer that failed before it stored
                    # anything frees it): a reader waiting for the key learns now, and a late
                    # write is refused, instead of either waiting out its deadline.
                    gone = (StateReleasedError, f"key {name!r} was released before any write")
                    self._tombstones.add(name, gone)
                    self._key_created.notify_all()
                    self._notify_locked(name)
            self._stats.num_releases += num_keys
            return ReleaseResult(num_keys, num_bytes)

    def expire(self) -> int:
        """Frees every key whose lease ran out; returns how many (also done on every call)."""
        with self._lock:
            return self._expire_locked()

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire_locked()
            self._stats.num_spills = self._tiers.num_spills
            self._stats.num_prefix_keys = len(self._retained)
            self._stats.num_prefix_bytes = self._retained.num_bytes
            counters = {k: v for k, v in vars(self._stats).items() if k not in ("tiers", "num_keys")}
            return StoreStats(tiers=self._tiers.stats(), num_keys=len(self._entries), **counters)

    def close(self) -> None:
        """Frees everything (waiting readers fail with `StateReleasedError`) and closes the tiers."""
        with self._lock:
            self._closed = True
            self._key_created.notify_all()
            for entry in list(self._entries.values()):
                self._drop_locked(entry, StateReleasedError, f"key {entry.key!r} was freed: the store closed")
            for key in list(self._watchers):
                self._notify_locked(key)
            self._tiers.close()
            if self.arena is not None:
                self.arena.close()

    # ---- internals (the *_locked ones run under self._lock) ----------------------------------

    def _writable_locked(self, key: str, owner: str, lease_s: float | None) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            self._tombstones.raise_if_gone(key, "; a gone key is never written again")
            self._leases.grant(key, owner, lease_s or self.default_lease_s)
            entry = self._entries[key] = Entry(key, owner, self._lock)
            self._key_created.notify_all()
            self._notify_locked(key)
            return entry
        if entry.owner != owner:
            raise OwnershipError(f"key {key!r} belongs to {entry.owner!r}; {owner!r} may not write to it")
        if entry.sealed:
            raise KeySealedError(f"key {key!r} is sealed; its writer said it had put everything")
        if lease_s:
            self._leases.renew(key, lease_s)
        return entry

    def _live_locked(self, key: str) -> Entry:
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        self._stats.num_misses += 1
        self._tombstones.raise_if_gone(key)
        raise StateNotFoundError(
            f"no state under key {key!r} in this store; was it put here (check the handle's store_address)?"
        )

    def _wait_for_entry_locked(
        self, key: str, deadline: float | None, cancel: threading.Event | None
    ) -> Entry | None:
        """`key`'s entry once a put creates it; None if `cancel` got set first."""
        while (entry := self._entries.get(key)) is None:
            self._tombstones.raise_if_gone(key)
            if self._closed:
                raise StateReleasedError(f"key {key!r} will never arrive: the store closed")
            if cancel is not None and cancel.is_set():
                return None
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise StateTimeoutError(f"nothing was put under key {key!r} in time; is its writer running?")
            self._key_created.wait(remaining)
            self._expire_locked()
        return entry

    def _is_sealed_locked(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.sealed

    def _place_locked(self, entry: Entry, meta: ChunkMeta, data: bytes | memoryview) -> None:
        try:
            lost = self._tier_put_locked(entry.key, meta.id, data, pin=entry.num_pins > 0)
        except StoreFullError as e:
            raise StoreFullError(f"cannot store {meta.describe()}: {e}") from None
        for key, why in lost:
            self._evict_locked(key, why)

    def _evict_locked(self, key: str, why: str) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._stats.num_evictions += 1
            message = f"key {key!r} was evicted ({why}); give the store more memory_bytes/disk_bytes"
            self._drop_locked(entry, StateEvictedError, message)

    def _expire_locked(self) -> int:
        expired = self._leases.pop_expired()
        for key in expired:
            entry = self._entries[key]
            self._drop_locked(entry, LeaseExpiredError, f"key {key!r} expired: its lease ran out unclaimed")
        self._stats.num_expiries += len(expired)
        return len(expired)

    def _drop_locked(self, entry: Entry, cls: type[StateStoreError], why: str) -> int:
        for cid in entry.order:
            if cid not in entry.locations:
                self._tiers.remove(cid)
        for region in entry.regions.values():
            self._spare_regions.pop(region.name, None)
            self._tiers.remove(RegionId(entry.key, region.name))
            if self.arena is not None:
                self.arena.free(region)
        entry.on_held_bytes = None
        if entry.key in self._retained:
            self._retained.discard(entry.key)
            if cls is not StateReleasedError:  # evicted or corrupt, not freed on purpose
                self._stats.num_prefix_evictions += 1
        del self._entries[entry.key]
        self._leases.drop(entry.key)
        self._prefixes.forget(entry.key)
        self._tombstones.add(entry.key, (cls, why))
        entry.gone = (cls, why)
        entry.cond.notify_all()
        self._notify_locked(entry.key)
        return entry.num_bytes

    def _read(self, entry: Entry, meta: ChunkMeta) -> bytes | memoryview:
        cid = meta.id
        try:
            place = entry.locations.get(cid)
            data = place[0].view[place[1] : place[1] + meta.num_bytes] if place else self._tiers.fetch(cid)
            if data is None:  # it may be between tiers: moves happen under the lock
                with self._lock:
                    data = self._tiers.fetch(cid)
                    if data is None:
                        if entry.gone is None:  # a lost piece loses the key: never serve it partial
                            self._evict_locked(entry.key, f"{meta.describe()} is in no tier")
                        assert entry.gone is not None
                        cls, why = entry.gone
                        raise cls(why)
            checksum.verify(data, meta.checksum, f"{meta.describe()} as stored")
        except CorruptStateError as e:
            with self._lock:
                self._stats.num_corruptions += 1
                if self._entries.get(entry.key) is entry:
                    self._drop_locked(entry, CorruptStateError, f"key {entry.key!r} was dropped: {e}")
            raise
        with self._lock:
            self._stats.num_hits += 1
        return data
