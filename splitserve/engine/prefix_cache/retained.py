"""What the retention listener receives each time the engine keeps a snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.state_transfer import LayerState


@dataclass
class RetainedPrefix:
    """A copy of a retained prefix's whole state, owned by whoever receives it.

    `hash_chain` names its whole prefix units; tokens past the last whole unit (a boundary inside a
    unit, such as a prompt end) are `tail_token_ids`, so `num_tokens == len(hash_chain) * unit +
    len(tail_token_ids)`. `states` are copies of every MLA layer's KV rows 0..num_tokens and every
    KDA layer's conv and recurrent state at `num_tokens` (on the engine's device: copy them to the
    host on another thread, never on the engine's). A tensor-parallel engine's holds each KDA state
    as one piece per rank, naming its heads (`LayerState.heads`; engine/parallel/retained.py).
    """

    hash_chain: list[bytes]
    num_tokens: int
    tail_token_ids: list[int]
    states: list[LayerState]
