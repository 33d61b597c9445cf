"""A prefix's state fetched from elsewhere (a store), handed to `LLMEngine.add_request`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from splitserve.engine.parallel.heads import take_heads
from splitserve.engine.state_transfer import LayerState
from splitserve.state import CorruptStateError, HeadRange, StateKind


@dataclass
class ImportedPrefix:
    """The state of the first `num_tokens` tokens of a prompt, computed by another engine.

    `hash_chain` names the whole prefix units it covers (`splitserve.prefix_hash`, the same salt
    as the request's chain). `states` holds every MLA layer's KV rows `token_start`..num_tokens
    (one piece or several, each with its token range) and every KDA layer's conv and recurrent
    state at `num_tokens`, each whole or as pieces naming their heads (`LayerState.heads`: a
    tensor-parallel engine published it, one piece per rank) that together hold every head; an
    engine keeps its own heads of them (`for_heads`). The engine scatters it into the request's blocks and slot when it
    schedules the request, skips those tokens, and keeps the prefix in its own cache as if
    computed locally (without handing it to the retention listener: it came from there).

    `token_start` > 0 makes it a delta: it extends the engine's own hit of at least `token_start`
    tokens (rows before it are not carried). If, when the request is scheduled, the local hit is
    shorter than `token_start` (evicted meanwhile), the import is dropped whole and the request
    computes from its local hit: a partial state is never used.
    It must leave at least one prompt token to compute (the sample needs that token's logits):
    one covering the whole prompt, or one the local cache beats, is ignored.
    """

    num_tokens: int
    hash_chain: list[bytes]
    states: list[LayerState]
    token_start: int = 0

    @property
    def num_bytes(self) -> int:
        return sum(state.num_bytes for state in self.states)

    def for_heads(self, want: HeadRange) -> ImportedPrefix:
        """This prefix as an engine (or tensor-parallel rank) holding KDA heads `want` takes it
        (`heads.take_heads`: a piece holding exactly those is not copied). Raises ValueError if a
        head is missing."""
        try:
            states = take_heads(self.states, want)
        except CorruptStateError as exc:
            raise ValueError(f"imported prefix of {self.num_tokens} tokens: {exc}") from exc
        return dataclasses.replace(self, states=states)

    def delta_from(self, token_start: int) -> ImportedPrefix:
        """This prefix without the MLA rows before `token_start` (a delta over a local hit of at
        least that many tokens); the tensors are views, not copies."""
        if not self.token_start <= token_start < self.num_tokens:
            raise ValueError(
                f"a delta of a prefix covering [{self.token_start}, {self.num_tokens}) must start inside it, "
                f"not at {token_start}"
            )
        states = []
        for state in self.states:
            if state.kind is StateKind.MLA_KV and state.token_start < token_start:
                if state.token_end <= token_start:
                    continue
                skip = token_start - state.token_start
                state = dataclasses.replace(state, tensor=state.tensor[skip:], token_start=token_start)
            states.append(state)
        return ImportedPrefix(self.num_tokens, self.hash_chain, states, token_start)
