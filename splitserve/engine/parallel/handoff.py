"""A request's state handed between engines of different tensor-parallel widths.

Prefill at width a: every rank extracts its own share of each KDA state (its heads) as rank 0
does; rank 0 exports its share, naming its heads, and after the step the share of each other rank
(`FollowerExports`, sent back over the rank's connection), so the store holds a head-ranged piece
per prefill rank and nobody concatenates them. MLA rows are the latent every rank holds: rank 0
alone exports them.

Decode at width b (`ShardingSink`): each KDA piece is cut or joined into the heads a decode rank
owns (`heads.assemble`: only the overlap of each piece is copied) as soon as the pieces that landed
cover them; MLA rows go to every rank whole. In a cluster every rank reads the key from the store
itself (`read_on_ranks`, splitserve/worker/rank_reads.py) and keeps its own heads; pieces written to
rank 0 otherwise (a caller holding them, a resume from stored state) are forwarded to each rank cut
to its heads. A width-1 engine reading a TP prefill's pieces assembles its (every) head the same way.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.engine.parallel.group import TensorParallel
from splitserve.engine.parallel.heads import assemble, heads_of, rank_heads
from splitserve.engine.state_transfer import LayerState
from splitserve.state import HeadRange, StateKind

if TYPE_CHECKING:
    from splitserve.engine.transfer_sink import TransferSink


@dataclass(frozen=True)
class StoreRead:
    """Where a reservation's state is, for ranks that read it themselves: the store, the key, how
    long to wait for it, whether the store's arena may be mapped (None: where it shares the node),
    and the deployment's internal token."""

    address: str
    key: str
    timeout_s: float
    shared_memory: bool | None = None
    cluster_token: str | None = field(default=None, repr=False)  # never in a log line


Export = Callable[[LayerState], None]
Forward = Callable[[int, LayerState], None]  # (rank, its piece)


def with_heads(state: LayerState, heads: HeadRange) -> LayerState:
    """`state` naming `heads` (a KDA piece a rank of a wider engine extracted); MLA rows unchanged."""
    if state.kind is StateKind.MLA_KV or state.heads is not None:
        return state
    return dataclasses.replace(state, heads=heads)


class DriverExports:
    """Rank 0's side of a tensor-parallel prefill's export: its own KDA shares named by its heads,
    and which export took each this step, in order. Every rank extracts the same shares in the same
    order, so the i-th share a rank sends back belongs to the i-th export here (no request ids:
    samples and their ids need not match)."""

    def __init__(self, tp: TensorParallel, num_heads: int) -> None:
        self.heads = rank_heads(num_heads, tp.rank, tp.size)
        self.calls: list[tuple[Export, int, StateKind]] = []  # this step's KDA exports

    def wrap(self, export: Export) -> Export:
        def rank0_export(state: LayerState) -> None:
            if state.kind is not StateKind.MLA_KV and state.heads is None:
                self.calls.append((export, state.layer_id, state.kind))
            export(with_heads(state, self.heads))

        return rank0_export

    def take_calls(self) -> list[tuple[Export, int, StateKind]]:
        calls, self.calls = self.calls, []
        return calls

    @staticmethod
    def relay(calls: list[tuple[Export, int, StateKind]], pieces: list[LayerState], rank: int) -> None:
        """Hand rank `rank`'s shares to the exports that took rank 0's, in order."""
        if len(pieces) != len(calls):
            raise RuntimeError(
                f"rank {rank} exported {len(pieces)} KDA shares this step; rank 0 {len(calls)}"
            )
        for (export, layer, kind), piece in zip(calls, pieces):
            if (piece.layer_id, piece.kind) != (layer, kind):
                raise RuntimeError(
                    f"rank {rank} exported layer {piece.layer_id} {piece.kind} where rank 0 {layer} {kind}"
                )
            export(piece)


class FollowerExports:
    """A rank > 0's KDA shares of its prefill-only requests, kept until the step ends and sent to
    rank 0 in the order it extracted them (the rank's copy of an exporting request exports only
    these: MLA rows are rank 0's)."""

    def __init__(self, tp: TensorParallel, num_heads: int) -> None:
        self.heads = rank_heads(num_heads, tp.rank, tp.size)
        self.pieces: list[LayerState] = []

    def export(self, state: LayerState) -> None:
        if state.kind is not StateKind.MLA_KV:
            self.pieces.append(with_heads(state, self.heads))

    def take(self) -> list[LayerState]:
        pieces, self.pieces = self.pieces, []
        return pieces


def _overlap(piece: LayerState, want: HeadRange) -> int:
    have = heads_of(piece, want.num_heads)
    return max(0, min(have.end, want.end) - max(have.start, want.start))


class ShardingSink:
    """Owns the re-sharding of one reservation's arriving state onto an engine's ranks.

    Wraps the rank's own `TransferSink` (`write` from the reader's thread, `complete`, `missing`,
    `close` as it does). KDA pieces of any width wait (by reference: a piece read in place stays
    valid until the key is released after admission) until those of a (layer, kind) cover a
    rank's heads; each rank then gets exactly its heads. `forward` (rank 0 of a tensor-parallel
    engine) hands the other ranks theirs and every MLA piece; None: this rank only.
    """

    def __init__(
        self, local: TransferSink, tp: TensorParallel, num_heads: int, forward: Forward | None = None
    ) -> None:
        self.local = local
        self._tp = tp
        self._forward = forward
        self._ranks = list(range(tp.size)) if forward is not None else [tp.rank]
        self._wants = {r: rank_heads(num_heads, r, tp.size) for r in self._ranks}
        self._pending: dict[tuple[int, StateKind], tuple[list[LayerState], set[int]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def complete(self) -> bool:
        return self.local.complete

    def own_heads_only(self) -> None:
        """The other ranks read the state themselves: take this rank's heads, forward nothing."""
        with self._lock:
            self._forward = None
            self._ranks = [self._tp.rank]
            self._wants = {self._tp.rank: self._wants[self._tp.rank]}

    def missing(self) -> str:
        return self.local.missing()

    def close(self) -> bool:
        """No more writes here or to the other ranks (waits for one in progress)."""
        with self._lock:
            self._closed = True
        return self.local.close()

    def write(self, state: LayerState) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the reservation was admitted or freed; no more state is taken in")
            if state.kind is StateKind.MLA_KV:
                for rank in self._ranks:
                    self._deliver(rank, state)
                return
            pieces, served = self._pending.setdefault((state.layer_id, state.kind), ([], set()))
            pieces.append(state)
            try:
                for rank, want in self._wants.items():
                    if rank in served or sum(_overlap(p, want) for p in pieces) < want.end - want.start:
                        continue
                    exact = state.heads == want or (
                        state.heads is None and want.end - want.start == want.num_heads
                    )
                    self._deliver(rank, state if exact else assemble(pieces, want))
                    served.add(rank)
            except BaseException:
                pieces.pop()  # the piece (appended last) does not fit: refused, not kept
                raise
            if len(served) == len(self._wants):
                del self._pending[(state.layer_id, state.kind)]

    def _deliver(self, rank: int, state: LayerState) -> None:
        if rank == self._tp.rank:
            self.local.write(state)
        else:
            assert self._forward is not None
            self._forward(rank, state)
