"""Finding a request's longest usable hit: all or nothing, KV of every unit and a snapshot at the end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.request import Request
from splitserve.prefix_hash import extend

if TYPE_CHECKING:
    from splitserve.engine.prefix_cache.cache import PrefixCache


@dataclass(frozen=True)
class Hit:
    """The first `num_tokens` tokens can be skipped: `kv_keys` (whole units, then a tail if the
    boundary is inside a unit) hold every MLA layer's rows, `snapshot_key` the KDA state there."""

    num_tokens: int
    kv_keys: list[bytes]
    snapshot_key: bytes


@dataclass(frozen=True)
class Match:
    """The hit (None without one) and how far the KV alone matched (for the lost-to-state count)."""

    hit: Hit | None
    kv_tokens: int


def find_hit(cache: PrefixCache, request: Request, chain: list[bytes], limit: int) -> Match:
    """The deepest boundary at most `limit` tokens in where the KV of every unit before it, the
    tail's KV (inside a unit) and a snapshot all exist. Deepest first: tails after the deepest
    matched unit, then that unit's own boundary, then one unit shallower, and so on."""
    unit, index, snapshots = cache.unit, cache.blocks.index, cache.snapshots
    num_units = 0
    while num_units < len(chain) and (num_units + 1) * unit <= limit and chain[num_units] in index:
        num_units += 1
    kv_tokens = num_units * unit
    for i in range(num_units, -1, -1):
        parent = cache.naming.parent(chain, i)
        start = i * unit
        for length in cache.tail_lengths(parent):
            end = start + length
            if end > limit:
                continue
            key = extend(parent, [request.token_at(p) for p in range(start, end)])
            if key not in index:
                continue
            kv_tokens = max(kv_tokens, end)
            if key in snapshots:
                return Match(Hit(end, [*chain[:i], key], key), kv_tokens)
        if i and chain[i - 1] in snapshots:
            return Match(Hit(start, list(chain[:i]), chain[i - 1]), kv_tokens)
    return Match(None, kv_tokens)
