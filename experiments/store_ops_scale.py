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

Figures only: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable

from state_store.arena import Arena, Region
from state_store.memory_tier import MemoryTier

OBJECT_BYTES = 64
NUM_UNPINNED = 100
MIN_REGION_BYTES, MAX_REGION_BYTES = 4 << 10, 4 << 20


def _thread_cpu_us(fn: Callable[[], object]) -> float:
    start = time.thread_time_ns()
    fn()
    return (time.thread_time_ns() - start) / 1e3


def measure_tier(num_pinned: int, num_calls: int) -> dict[str, float]:
    """Median thread-CPU microseconds of a put that evicts, a get, and a pin+unpin pair."""
    tier = MemoryTier((num_pinned + NUM_UNPINNED) * OBJECT_BYTES)
    data = bytes(OBJECT_BYTES)
    for n in range(num_pinned):
        tier.put(("pinned", n), data)
        tier.pin(("pinned", n))
    for n in range(NUM_UNPINNED):
        tier.put(("kept", n), data)
    rng = random.Random(num_pinned)
    put_us = [_thread_cpu_us(lambda n=n: tier.put(("new", n), data)) for n in range(num_calls)]
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


def measure_arena(num_pooled: int, num_calls: int) -> float:
    """Median thread-CPU microseconds of an `allocate` served from a pool of `num_pooled` regions."""
    rng = random.Random(num_pooled)
    sizes = [rng.randrange(MIN_REGION_BYTES, MAX_REGION_BYTES) for _ in range(num_pooled)]
    with tempfile.TemporaryDirectory() as root:
        arena = Arena(root, pool_bytes=sum(sizes))
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", default="1000,10000,50000", help="object counts, comma-separated")
    parser.add_argument("--calls", type=int, default=200, help="timed calls of each kind per count")
    args = parser.parse_args(argv)
    print("median thread CPU per call, microseconds")
    print(f"{'objects':>8} {'put under pressure':>19} {'get':>6} {'pin+unpin':>10} {'allocate':>9}")
    for num in (int(n) for n in args.objects.split(",")):
        tier = measure_tier(num, args.calls)
        allocate_us = measure_arena(num, args.calls)
        print(
            f"{num:>8,} {tier['put_us']:>19.1f} {tier['get_us']:>6.1f} {tier['pin_us']:>10.1f} "
            f"{allocate_us:>9.1f}"
        )


if __name__ == "__main__":
    main()
