"""Swap preemption: a decoding request that loses its KV room parks its state and comes back to it.

With `EngineConfig.preemption_mode = "swap"`, the scheduler hands a preempted request that is
decoding to the `Swapper`, which copies its whole state (every MLA layer's KV rows 0..n and every
KDA layer's conv and recurrent state at n, as `LayerState`s) into a `SwapSpace` before its blocks
and slot are freed. When the request is admitted again, fresh blocks and a fresh slot are held for
it, the state is scattered back and it goes on decoding at token n: nothing is recomputed.

A request still computing its prompt (or a prefill-only one, which ends after its first token)
is always preempted by recompute: the part of its prompt it computed is cheap to redo next to the
rest, and a prefill's export streams its rows as they are computed. Whenever the swap space
refuses a state (its budget is full, a store fails) or cannot give it back, that request falls
back to recompute (counted in `SwapStats.num_recompute_fallbacks`), with the same tokens: it
never fails.

`HostSwapSpace` (the engine's default) keeps host copies under a byte budget, like vLLM's
`swap_space`; a cluster's decode worker uses its node's store instead (decode_worker/swap_space.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.request import Request
from splitserve.engine.state_transfer import (
    LayerState,
    cache_for,
    extract_kda,
    extract_mla_rows,
    token_rows,
    write_piece,
)
from splitserve.engine_config import EngineConfig
from splitserve.state import StateKind

logger = logging.getLogger(__name__)


class SwapSpace(Protocol):
    """Where preempted requests' states wait. Called on the engine thread: `put` and `take` may
    block for their copy, never longer than their own timeout. Neither raises: a refusal or a loss
    is a False or a None, and the engine recomputes that request instead."""

    def put(self, request_id: str, states: list[LayerState]) -> bool:
        """Keep `states` (copies the caller hands over) under `request_id`; False if not kept."""
        ...

    def take(self, request_id: str) -> list[LayerState] | None:
        """The states put under `request_id`, forgotten here; None if they are lost."""
        ...

    def drop(self, request_id: str) -> None:
        """Forget `request_id`'s states (the request ended while swapped); no-op if none."""
        ...


@dataclass
class SwapStats:
    """The swapper's counters since the engine started (they only grow)."""

    num_swapped_out: int = 0  # preemptions whose state went to the swap space
    num_swapped_in: int = 0  # readmissions that scattered it back (no recompute)
    num_swap_out_bytes: int = 0
    num_swap_in_bytes: int = 0
    # a decoding request recomputed after all: the space refused its state or lost it
    num_recompute_fallbacks: int = 0


class HostSwapSpace:
    """Owns host-memory copies of swapped states, `budget_bytes` at most in all.

    Promises: `put` refuses (False) a state that would take it past the budget and keeps nothing
    of it; `take` and `drop` give back the bytes at once. Engine thread only (not thread-safe).
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._held: dict[str, tuple[list[LayerState], int]] = {}

    def put(self, request_id: str, states: list[LayerState]) -> bool:
        num_bytes = sum(state.num_bytes for state in states)
        if request_id in self._held or self.used_bytes + num_bytes > self.budget_bytes:
            return False
        # the states are fresh copies already: on a CPU engine `.cpu()` keeps them as they are
        on_host = [dataclasses.replace(s, tensor=s.tensor.cpu()) for s in states]
        self._held[request_id] = (on_host, num_bytes)
        self.used_bytes += num_bytes
        return True

    def take(self, request_id: str) -> list[LayerState] | None:
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        self.used_bytes -= held[1]
        return held[0]

    def drop(self, request_id: str) -> None:
        self.take(request_id)


class Swapper:
    """Owns the engine's swap space and counters and moves states between it and the caches.

    The scheduler decides when (`swappable`, then `swap_out` before it frees a request's blocks
    and slot, `swap_in` once it holds new ones for the same number of tokens); this does the
    tensor work. Promises: after a False from either, the request holds nothing in the swap space
    and must be recomputed from token 0.
    """

    def __init__(self, caches: LayerCaches, block_size: int, space: SwapSpace) -> None:
        self.caches = caches
        self.block_size = block_size
        self.space = space
        self.stats = SwapStats()

    @staticmethod
    def swappable(request: Request) -> bool:
        """Decoding here (sampled at least one token on this engine) and not prefill-only."""
        return (
            not request.prefill_only
            and request.state_slot is not None
            and request.num_computed_tokens > 0
            and len(request.output_token_ids) > request.num_given_output_tokens
        )

    def swap_out(self, request: Request) -> bool:
        """Copy the request's state (its `num_computed_tokens` tokens) into the swap space."""
        assert request.state_slot is not None
        n, slot = request.num_computed_tokens, request.state_slot
        rows = token_rows(request.block_table, n, self.block_size)
        states = [extract_mla_rows(self.caches, lid, rows, 0, n) for lid in self.caches.mla_kv]
        for lid in self.caches.kda_conv:
            states.extend(extract_kda(self.caches, lid, slot, n))  # flushes a ReplaySSM ring first
        if not self.space.put(request.request_id, states):
            self.stats.num_recompute_fallbacks += 1
            return False
        self.stats.num_swapped_out += 1
        self.stats.num_swap_out_bytes += sum(s.num_bytes for s in states)
        return True

    def swap_in(self, request: Request) -> bool:
        """Scatter the request's swapped state into the blocks and slot it holds again."""
        assert request.state_slot is not None
        states = self.space.take(request.request_id)
        n = request.num_computed_tokens
        problem = "is lost" if states is None else self._problem(states, n)
        if states is None or problem:
            logger.warning(
                "swapped state of %s %s: recomputing its %d tokens", request.request_id, problem, n
            )
            self.stats.num_recompute_fallbacks += 1
            return False
        rows = token_rows(request.block_table, n, self.block_size)
        for state in states:
            write_piece(self.caches, state, rows, request.state_slot)
        self.stats.num_swapped_in += 1
        self.stats.num_swap_in_bytes += sum(s.num_bytes for s in states)
        return True

    def drop(self, request: Request) -> None:
        self.space.drop(request.request_id)

    def _problem(self, states: list[LayerState], num_tokens: int) -> str | None:
        """What keeps `states` from being the whole state of `num_tokens` tokens in this engine's
        caches (every MLA layer's rows 0..num_tokens and every KDA layer's two states, once each,
        each of the caches' shape and dtype); None if nothing does."""
        have = sorted((s.layer_id, StateKind(s.kind).value, s.token_start, s.token_end) for s in states)
        kda = (StateKind.KDA_CONV.value, StateKind.KDA_RECURRENT.value)
        want = [(lid, StateKind.MLA_KV.value, 0, num_tokens) for lid in self.caches.mla_kv]
        want += [(lid, kind, 0, num_tokens) for lid in self.caches.kda_conv for kind in kda]
        if have != sorted(want):
            return f"is incomplete ({len(have)} pieces, {len(want)} expected)"
        try:
            for state in states:
                cache_for(self.caches, state)
        except ValueError as exc:
            return f"does not fit ({exc})"
        return None


def make_swapper(config: EngineConfig, caches: LayerCaches) -> Swapper | None:
    """A swapper over a `HostSwapSpace` of `config.swap_space_bytes` in swap mode, else None."""
    if config.preemption_mode != "swap":
        return None
    return Swapper(caches, config.block_size, HostSwapSpace(config.swap_space_bytes))
