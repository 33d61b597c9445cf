"""Micro-benchmark: the store's CPU per `Stats` and per `Register` against how many prefixes it retains.

    python -m experiments.prefix_store_scale [--keys 100,1000,10000] [--chunks-per-key 16]
        [--chunk-bytes 256] [--calls 50]

For each count N, a `StateStore` (RAM tier only, no gRPC) holds N retained prefixes (sealed keys
of `chunks_per_key` chunks, each registered under its own hash chain) with the prefix budget set
to exactly what they hold, so every further `register` of a new key evicts the least recently hit
one: the steady state of a store whose prefix cache is full. Timed per call, in thread CPU time
(the box is shared; wall time would count other processes): `stats()`, and `register()` of a key
put beforehand (the put is not timed).

"before" runs the same store with the previous `RetainedPrefixes` (`_SummingRetained` below: the
total summed over every retained key's chunk metas on each read, as the store did until the
running count), "after" the current one. Figures only: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Callable

from splitserve.state import checksum
from splitserve.state.chunk import Chunk, ChunkMeta, StateKind
from state_store.memory_tier import MemoryTier
from state_store.retained import RetainedPrefixes
from state_store.store import StateStore

OWNER = "prefix-bench"


class _SummingRetained(RetainedPrefixes):
    """The retained prefixes as the store kept them before the running count: the total summed
    through `size_of` (which summed each key's chunk metas) whenever it was asked for, and again
    in `over_budget`. The LRU order is the current class's."""

    def __init__(self, budget_bytes: int | None, size_of: Callable[[str], int]) -> None:
        super().__init__(budget_bytes)
        self._size_of = size_of

    @property
    def num_bytes(self) -> int:
        return sum(self._size_of(key) for key in self._sizes)

    def over_budget(self) -> list[str]:
        if self.budget_bytes is None:
            return []
        excess = self.num_bytes - self.budget_bytes
        victims = []
        for key in self._sizes:
            if excess <= 0:
                break
            victims.append(key)
            excess -= self._size_of(key)
        return victims


def _chunks(key: str, num_chunks: int, chunk_bytes: int, rng: random.Random) -> list[Chunk]:
    made = []
    for i in range(num_chunks):
        data = rng.randbytes(chunk_bytes)
        meta = ChunkMeta(
            key, i, StateKind.KDA_RECURRENT, "uint8", (chunk_bytes,), 0, 64, checksum.compute(data), 0, 1
        )
        made.append(Chunk(meta, data))
    return made


def _put_and_register(store: StateStore, key: str, chunks: list[Chunk]) -> Callable[[], None]:
    """Puts `key`'s chunks (sealed); returns its registration, to be timed by the caller."""
    for i, chunk in enumerate(chunks):
        store.put(chunk, owner=OWNER, final=i == len(chunks) - 1)
    return lambda: store.register([key.encode()], key, num_tokens=64)


def _thread_cpu_us(fn: Callable[[], object]) -> float:
    start = time.thread_time_ns()
    fn()
    return (time.thread_time_ns() - start) / 1e3


def measure(
    num_keys: int, chunks_per_key: int, chunk_bytes: int, num_calls: int, summing: bool
) -> dict[str, float]:
    """Median thread-CPU microseconds of `stats()` and `register()` with `num_keys` retained."""
    key_bytes = chunks_per_key * chunk_bytes
    total_bytes = (num_keys + num_calls + 1) * key_bytes
    # no budget while it fills (else filling the summing store costs O(N^2)), then exactly full
    store = StateStore(MemoryTier(2 * total_bytes), default_lease_s=3600.0, prefix_budget_bytes=None)
    if summing:
        store._retained = _SummingRetained(  # type: ignore[assignment]
            store._retained.budget_bytes, lambda key: store._entries[key].count_held_bytes()
        )
    rng = random.Random(num_keys)
    one_key = _chunks("template", chunks_per_key, chunk_bytes, rng)

    def chunks_of(key: str) -> list[Chunk]:  # the same bytes under another key: checksums still hold
        return [Chunk(dataclasses.replace(c.meta, key=key), c.data) for c in one_key]

    try:
        for n in range(num_keys):
            _put_and_register(store, f"kept-{n}", chunks_of(f"kept-{n}"))()
        assert store.stats().num_prefix_keys == num_keys
        store._retained.budget_bytes = num_keys * key_bytes
        stats_us = [_thread_cpu_us(store.stats) for _ in range(num_calls)]
        register_us = []
        for n in range(num_calls):
            register = _put_and_register(store, f"new-{n}", chunks_of(f"new-{n}"))
            register_us.append(_thread_cpu_us(register))  # evicts the least recently hit key
        after = store.stats()
        assert after.num_prefix_keys == num_keys and after.num_prefix_evictions == num_calls
        return {"stats_us": statistics.median(stats_us), "register_us": statistics.median(register_us)}
    finally:
        store.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default="100,1000,10000", help="retained-key counts, comma-separated")
    parser.add_argument("--chunks-per-key", type=int, default=16)
    parser.add_argument("--chunk-bytes", type=int, default=256)
    parser.add_argument("--calls", type=int, default=50, help="timed calls of each kind per count")
    args = parser.parse_args(argv)
    print(f"{args.chunks_per_key} chunks per key; median thread CPU per call, microseconds")
    print(
        f"{'retained keys':>14} {'Stats before':>13} {'Stats after':>12} {'Register before':>16} {'Register after':>15}"
    )
    for num_keys in (int(n) for n in args.keys.split(",")):
        before = measure(num_keys, args.chunks_per_key, args.chunk_bytes, args.calls, summing=True)
        after = measure(num_keys, args.chunks_per_key, args.chunk_bytes, args.calls, summing=False)
        print(
            f"{num_keys:>14,} {before['stats_us']:>13.1f} {after['stats_us']:>12.1f} "
            f"{before['register_us']:>16.1f} {after['register_us']:>15.1f}"
        )


if __name__ == "__main__":
    main()
