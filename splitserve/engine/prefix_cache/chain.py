"""One request's prefix names and cache bookkeeping: its hash chain, grown as its tokens are."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.request import Request
from splitserve.prefix_hash import extend, root


@dataclass
class RequestCacheState:
    """What the prefix cache tracks for one request (kept on `Request.cache_state`).

    `chain[i]` names tokens 0..(i + 1) * unit of the request's tokens (prompt, then outputs);
    `boundaries` are the snapshots planned at its admission still ahead of it; `local_boundary`
    is the one among them kept for this engine only (not handed to the retention listener).
    """

    chain: list[bytes] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)
    local_boundary: int | None = None
    num_published_units: int = 0
    admitted: bool = False  # counted in the stats and recorded in the sketch (first admission)
    # what the last `admit` found, committed to the stats by `confirm` on the first admission:
    # (tokens hit locally, tokens imported, tokens whose KV matched)
    pending: tuple[int, int, int] = (0, 0, 0)


class Naming:
    """Names prefixes of requests' tokens with one salt and unit (`splitserve.prefix_hash`)."""

    def __init__(self, unit: int, salt: bytes) -> None:
        self.unit = unit
        self.root = root(salt)

    def state(self, request: Request) -> RequestCacheState:
        st = request.cache_state
        if st is None:
            st = RequestCacheState(chain=list(request.prefix_hashes or []))
            request.cache_state = st
        return st

    def chain(self, request: Request, num_tokens: int) -> list[bytes]:
        """The request's chain, grown to name every whole unit of its first `num_tokens` tokens."""
        st, unit = self.state(request), self.unit
        while len(st.chain) < num_tokens // unit:
            start = len(st.chain) * unit
            parent = st.chain[-1] if st.chain else self.root
            st.chain.append(extend(parent, [request.token_at(p) for p in range(start, start + unit)]))
        return st.chain

    def parent(self, chain: list[bytes], num_units: int) -> bytes:
        """The name of the first `num_units` units (the root for none)."""
        return chain[num_units - 1] if num_units else self.root

    def key(self, request: Request, num_tokens: int) -> bytes:
        """The name of the request's first `num_tokens` tokens: a chain element at a unit boundary,
        else the deepest whole unit's name extended by the tail."""
        chain = self.chain(request, num_tokens)
        whole, tail = divmod(num_tokens, self.unit)
        if not tail:
            return chain[whole - 1]
        start = whole * self.unit
        return extend(self.parent(chain, whole), [request.token_at(p) for p in range(start, num_tokens)])
