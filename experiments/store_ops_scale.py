"""Micro-benchmark: the store's per-operation CPU against how many objects its tier and arena pool hold.

    python -m experiments.store_ops_scale [--objects 1000,10000,50000] [--calls 200]

For each count N, timed per call in thread CPU time (the box is shared; wall time would count
other processes), median over `calls`:

* `put under pressure`: a `MemoryTier` exactly full with N pinned objects (the oldest: requests in
  flight pin their state, and a retained prefix's arena region is pinned while its key lives)
  and 100 unpinned ones after them; each put of a new 64-byte object evicts the oldest unpinned one.
* `get`: a read of a random object (it refreshes the object's recency).
* `pin+unpin`: pinning then unpinning a random unpinned object.
* `allocate`: `Arena.allocate` of a size some freed region fits, with N freed regions (sizes
  4 KiB .. 4 MiB) in the arena's pool; the region is freed back untimed. The pooled regions are
  bookkeeping only (no files): a hit never touches the filesystem.

And per count of chunks C in one retained key (`--chunks`, default 16,256,1024: a 30k-token
history of the 48B model is ~270 MiB, ~270 chunks of 1 MiB): a prefix `Lookup` that hits it,
answered by the servicer and serialised as gRPC would (no network), and the answer's size.

"before" runs the same tier and arena with the rules they had until the change (below:
`_ScanningIndex`, victims found by walking every object from the oldest, pinned ones skipped;
`_ScanningPool`, the freed regions scanned for the smallest fit), "after" the current ones. The
before index keeps the current structures up as well (it subclasses them), so its get and
pin+unpin carry both; its put's walk is the old one. Figures only: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from experiments.prefix_store_scale import _chunks, _put_and_register
from splitserve.state.errors import TierFullError
from splitserve.state.wire import key_info_to_proto
from splitserve.v1 import store_pb2
from state_store.arena import Arena, Region
from state_store.arena_pool import RegionPool
from state_store.lru import LruIndex
from state_store.memory_tier import MemoryTier
from state_store.servicer import StateStoreServicer
from state_store.store import StateStore

OBJECT_BYTES = 64
NUM_UNPINNED = 100
MIN_REGION_BYTES, MAX_REGION_BYTES = 4 << 10, 4 << 20


class _ScanningIndex(LruIndex):
    """The victims rule before the change: one recency order of every object, pinned or not,
    walked from the oldest on each put under pressure."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name, capacity_bytes)
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, oid: Hashable) -> None:
        super().touch(oid)
        self._order[oid] = None
        self._order.move_to_end(oid)

    def discard(self, oid: Hashable) -> int:
        self._order.pop(oid, None)
        return super().discard(oid)

    def victims(self, oid: Hashable, size: int) -> list[Hashable]:
        free = self.capacity_bytes - self.num_bytes + self._sizes.get(oid, 0)
        chosen: list[Hashable] = []
        for candidate in self._order:
            if free >= size:
                break
            if candidate == oid or candidate in self._pins:
                continue
            chosen.append(candidate)
            free += self._sizes[candidate]
        if free < size:
            raise TierFullError(f"cannot fit {size} bytes")
        return chosen


class _ScanningPool(RegionPool):
    """The arena's pool before the change: a list of freed regions scanned on every allocate."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._list: list[Region] = []

    def add(self, region: Region) -> bool:
        if not region.num_bytes or self.num_bytes + region.num_bytes > self.capacity_bytes:
            return False
        self._list.append(region)
        self.num_bytes += region.num_bytes
        return True

    def take(self, num_bytes: int) -> Region | None:
        fits = [r for r in self._list if num_bytes <= r.num_bytes <= 2 * num_bytes]
        if not fits:
            return None
        region = min(fits, key=lambda r: r.num_bytes)
        self._list.remove(region)
        self.num_bytes -= region.num_bytes
        return region


def _thread_cpu_us(fn: Callable[[], object]) -> float:
    start = time.thread_time_ns()
    fn()
    return (time.thread_time_ns() - start) / 1e3


def measure_tier(num_pinned: int, num_calls: int, before: bool) -> dict[str, float]:
    """Median thread-CPU microseconds of a put that evicts, a get, and a pin+unpin pair."""
    tier = MemoryTier((num_pinned + NUM_UNPINNED) * OBJECT_BYTES)
    if before:
        tier._index = _ScanningIndex(tier.name, tier.capacity_bytes)
    data = bytes(OBJECT_BYTES)
    for n in range(num_pinned):
        tier.put(("pinned", n), data)
        tier.pin(("pinned", n))
    for n in range(NUM_UNPINNED):
        tier.put(("kept", n), data)
    rng = random.Random(num_pinned)
    put_us = [_thread_cpu_us(functools.partial(tier.put, ("new", n), data)) for n in range(num_calls)]
    assert tier.stats().num_objects == num_pinned + NUM_UNPINNED  # each put evicted one
    get_us = [
        _thread_cpu_us(lambda: tier.get(("pinned", rng.randrange(num_pinned)))) for _ in range(num_calls)
    ]
    unpinned = [("new", n) for n in range(num_calls - NUM_UNPINNED, num_calls)]

    def pin_unpin() -> None:
        oid = rng.choice(unpinned)
        tier.pin(oid)
        tier.unpin(oid)

    pin_us = [_thread_cpu_us(pin_unpin) for _ in range(num_calls)]
    tier.close()
    return {
        "put_us": statistics.median(put_us),
        "get_us": statistics.median(get_us),
        "pin_us": statistics.median(pin_us),
    }


def measure_arena(num_pooled: int, num_calls: int, before: bool) -> float:
    """Median thread-CPU microseconds of an `allocate` served from a pool of `num_pooled` regions."""
    rng = random.Random(num_pooled)
    sizes = [rng.randrange(MIN_REGION_BYTES, MAX_REGION_BYTES) for _ in range(num_pooled)]
    with tempfile.TemporaryDirectory() as root:
        arena = Arena(root, pool_bytes=sum(sizes))
        if before:
            arena._pool = _ScanningPool(arena.pool_bytes)
        try:
            for n, size in enumerate(sizes):  # bookkeeping only: a pooled hit maps nothing
                arena.free(Region(f"fake-{n}", size, memoryview(b"")))
            times_us = []
            for _ in range(num_calls):
                wanted = rng.choice(sizes)
                region = None

                def allocate(wanted: int = wanted) -> None:
                    nonlocal region
                    region = arena.allocate(wanted)

                times_us.append(_thread_cpu_us(allocate))
                assert region is not None and region.name.startswith("fake-")  # served from the pool
                arena.free(region)
            return statistics.median(times_us)
        finally:
            arena.close()


def _answer_before(store: StateStore, request: store_pb2.LookupRequest) -> store_pb2.LookupResponse:
    """The prefix `Lookup` before the change: the hit's key info with every chunk's metadata."""
    found = store.match_prefix(list(request.prefix.hashes), list(request.token_ids) or None)
    info = store.lookup(found.key) if found.key is not None else None
    return key_info_to_proto(info, found.num_units, found.num_tokens)


def _answer_now(servicer: StateStoreServicer, request: store_pb2.LookupRequest) -> store_pb2.LookupResponse:
    """The servicer's answer; a prefix `Lookup` never awaits, so its coroutine ends on first send."""
    try:
        servicer.Lookup(request, None).send(None)  # type: ignore[arg-type]
    except StopIteration as done:
        return done.value
    raise AssertionError("Lookup awaited something: run it on an event loop instead")


def measure_lookup(num_chunks: int, num_calls: int, before: bool) -> tuple[float, int]:
    """Median thread-CPU microseconds of a prefix `Lookup` hitting a key of `num_chunks` chunks,
    serialisation included, and the answer's size in bytes."""
    store = StateStore(MemoryTier(1 << 30), default_lease_s=3600.0)
    try:
        _put_and_register(store, "kept", _chunks("kept", num_chunks, 64, random.Random(num_chunks)))()
        request = store_pb2.LookupRequest(prefix=store_pb2.PrefixHashes(hashes=[b"kept"]))
        servicer = StateStoreServicer(store, executor=None)  # type: ignore[arg-type]  # unused by Lookup

        def answer() -> store_pb2.LookupResponse:
            return _answer_before(store, request) if before else _answer_now(servicer, request)

        reply = answer()
        assert reply.found and reply.key == "kept" and reply.num_units == 1
        times_us = [_thread_cpu_us(lambda: answer().SerializeToString()) for _ in range(num_calls)]
        return statistics.median(times_us), reply.ByteSize()
    finally:
        store.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", default="1000,10000,50000", help="object counts, comma-separated")
    parser.add_argument("--chunks", default="16,256,1024", help="chunks per key for Lookup, comma-separated")
    parser.add_argument("--calls", type=int, default=200, help="timed calls of each kind per count")
    args = parser.parse_args(argv)
    print("median thread CPU per call, microseconds, before / after")
    columns = ("put under pressure", "get", "pin+unpin", "allocate")
    print(f"{'objects':>8} " + " ".join(f"{name:>20}" for name in columns))
    for num in (int(n) for n in args.objects.split(",")):
        figures = {}
        for before in (True, False):
            tier = measure_tier(num, args.calls, before)
            figures[before] = [
                tier["put_us"],
                tier["get_us"],
                tier["pin_us"],
                measure_arena(num, args.calls, before),
            ]
        pairs = [f"{old:,.1f} / {new:,.1f}" for old, new in zip(figures[True], figures[False])]
        print(f"{num:>8,} " + " ".join(f"{pair:>20}" for pair in pairs))
    print("\nprefix Lookup hitting one key, serialised: median thread CPU (us) and answer size (bytes)")
    print(f"{'chunks':>8} {'CPU before / after':>20} {'bytes before / after':>22}")
    for num in (int(n) for n in args.chunks.split(",")):
        (old_us, old_bytes), (new_us, new_bytes) = (measure_lookup(num, args.calls, b) for b in (True, False))
        print(f"{num:>8,} {f'{old_us:,.1f} / {new_us:,.1f}':>20} {f'{old_bytes:,} / {new_bytes:,}':>22}")


if __name__ == "__main__":
    main()
