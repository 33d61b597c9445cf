"""What an engine tells a router about its prefix cache: prefixes it can serve, and ones it no longer can."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PrefixEvent:
    """`stored`: a hit of `num_tokens` tokens became possible under `block_hash`; `removed`: the
    last hit under it went (its snapshot or some of its KV was evicted).

    `block_hash` is the chain element (`splitserve.prefix_hash`) of the deepest whole unit at or
    below the hit's boundary: a request whose chain contains it shares at least those units. A
    hit shorter than one unit has no such name and is not announced.
    """

    kind: Literal["stored", "removed"]
    block_hash: bytes
    num_tokens: int
