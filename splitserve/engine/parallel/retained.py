"""A tensor-parallel engine's retained prefixes, whole: every rank's KDA heads, for one publish.

Every rank's prefix cache retains the same prefixes at the same point of the same call (the
engines are deterministic: commands.py), but a rank's snapshot holds its heads only. So while a
listener is set (`SetRetention`), each rank > 0 keeps its KDA shares of what it retains, naming
its heads (`FollowerRetained`; no MLA rows: they are rank 0's latent, the same everywhere), and
sends them back after the call, after any handoff exports of the call. Rank 0 holds its own
retained prefixes until then (`DriverRetained`), adds each rank's shares in order, and hands the
listener (the store's publisher) one prefix of one piece per rank per KDA state and every MLA
piece once. Nobody concatenates heads: a reader of any width takes its own (`heads.take_heads`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from splitserve.engine.parallel.group import TensorParallel
from splitserve.engine.parallel.handoff import with_heads
from splitserve.engine.parallel.heads import rank_heads
from splitserve.engine.prefix_cache.retained import RetainedPrefix
from splitserve.engine.state_transfer import LayerState
from splitserve.state import StateKind

Listener = Callable[[RetainedPrefix], None]


@dataclass
class RetainedShares:
    """What a rank > 0 sends rank 0 after a call that retained prefixes: per prefix, in the order
    it retained them, its KDA shares naming its heads."""

    rank: int
    shares: list[list[LayerState]]


def _kda_shares(prefix: RetainedPrefix, tp: TensorParallel, num_heads: int) -> list[LayerState]:
    heads = rank_heads(num_heads, tp.rank, tp.size)
    return [with_heads(s, heads) for s in prefix.states if s.kind is not StateKind.MLA_KV]


class FollowerRetained:
    """A rank > 0's KDA shares of the prefixes it retained during one call, until it sends them."""

    def __init__(self, tp: TensorParallel, num_heads: int) -> None:
        self._tp = tp
        self._num_heads = num_heads
        self.shares: list[list[LayerState]] = []

    def keep(self, prefix: RetainedPrefix) -> None:
        self.shares.append(_kda_shares(prefix, self._tp, self._num_heads))

    def take(self) -> RetainedShares:
        shares, self.shares = self.shares, []
        return RetainedShares(self._tp.rank, shares)


class DriverRetained:
    """Rank 0's retained prefixes of the call in progress, held until every rank's shares of them
    arrived (`complete`); then the listener hears each whole prefix, in order, on the engine thread."""

    def __init__(self, tp: TensorParallel, num_heads: int) -> None:
        self._tp = tp
        self._num_heads = num_heads
        self.listener: Listener | None = None
        self.held: list[RetainedPrefix] = []

    def hold(self, prefix: RetainedPrefix) -> None:
        mla = [s for s in prefix.states if s.kind is StateKind.MLA_KV]
        prefix.states = mla + _kda_shares(prefix, self._tp, self._num_heads)
        self.held.append(prefix)

    def complete(self, receive: Callable[[int], object]) -> None:
        """Add every other rank's shares (`receive(rank)`: its next message) to the held prefixes
        and hand them to the listener; nothing to do when this call retained none."""
        held, self.held = self.held, []
        if not held:
            return
        for rank in range(1, self._tp.size):
            got = receive(rank)
            if not isinstance(got, RetainedShares) or len(got.shares) != len(held):
                what = f"{len(got.shares)} prefixes" if isinstance(got, RetainedShares) else repr(got)[:80]
                raise RuntimeError(f"rank {rank} sent {what} where rank 0 retained {len(held)} prefixes")
            for prefix, shares in zip(held, got.shares):
                prefix.states.extend(shares)
        if self.listener is not None:
            for prefix in held:
                self.listener(prefix)
