"""Reads a lost decode worker's stored state of one request and rebuilds it for this worker to resume.

The lost worker kept, in its node's store, the request's base state under `state_key` and a
chain of ReplaySSM publishes after it (keys and encoding: engine/replay_codec.py). This walks the
chain from the prompt's end, piece after piece, and stops at the first piece that is missing,
still being written (not sealed), or that would cover a token the client never received (the
resumed state must end before the last token sent: that token is the one the resumed engine
computes from). `resume_states` rebuilds the state the pieces reach; the tokens sent after it
(fewer than `replay_window` when every publish landed) are recomputed by the resuming engine.

Errors say why the stored state cannot be used; the gateway then re-prefills instead:
`StateUnavailableError` (the base state is gone), `CorruptStateError` (a piece does not decode or
does not continue the chain), other `StateStoreError`s (the store failed).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.replay_codec import piece_key, publish_from_states
from splitserve.engine.replay_publish import ReplayPublish
from splitserve.engine.replay_resume import resume_states
from splitserve.engine.state_codec import decode, decode_pieces
from splitserve.engine.state_transfer import LayerState
from splitserve.state import CorruptStateError, StateKind
from splitserve.state.client import StateStoreClient


@dataclass
class StoredState:
    """A request's state rebuilt from a store: `states` cover its first `num_tokens` tokens
    (prompt + that many generated); `prompt_states` is the base it was rebuilt from; `keys` are
    what was read (the caller releases them once the state is in)."""

    num_tokens: int
    states: list[LayerState]
    prompt_states: list[LayerState]
    keys: list[str]
    num_pieces: int
    num_bytes: int


def read_stored_state(
    client: StateStoreClient,
    state_key: str,
    request_id: str,
    num_prompt_tokens: int,
    num_sent_tokens: int,
    timeout_s: float,
) -> StoredState:
    """The state of `request_id` kept under `state_key`, as far as its pieces reach without
    covering the last of the `num_sent_tokens` tokens the client received (see the module docstring)."""
    prompt_states = list(decode(client.get(state_key, timeout_s=timeout_s)))
    recurrent = [s for s in prompt_states if s.kind is StateKind.KDA_RECURRENT]
    if not recurrent or any(s.token_end != num_prompt_tokens for s in recurrent):
        raise CorruptStateError(
            f"stored state {state_key} does not end at the prompt's {num_prompt_tokens} tokens "
            f"({[s.token_end for s in recurrent]})"
        )
    head_dims = (int(recurrent[0].tensor.shape[-2]), int(recurrent[0].tensor.shape[-1]))
    limit = num_prompt_tokens + num_sent_tokens - 1
    chain = _chain(client, state_key, num_prompt_tokens)
    keys = [state_key] + [key for key, _ in chain]  # all of it: the caller releases what it read
    pieces: list[ReplayPublish] = []
    num_bytes = sum(s.num_bytes for s in prompt_states)
    start = num_prompt_tokens
    for key, end in chain:
        if end > limit:
            break
        piece = publish_from_states(
            request_id, decode_pieces(client.get(key, timeout_s=timeout_s)), head_dims
        )
        if (piece.token_start, piece.num_tokens) != (start, end):
            raise CorruptStateError(f"{key} covers tokens {piece.token_start}..{piece.num_tokens}")
        pieces.append(piece)
        num_bytes += piece.num_bytes
        start = end
    try:
        num_tokens, states = resume_states(prompt_states, pieces)
    except ValueError as exc:
        raise CorruptStateError(str(exc)) from exc
    return StoredState(num_tokens, states, prompt_states, keys, len(pieces), num_bytes)


def _chain(client: StateStoreClient, state_key: str, start: int) -> list[tuple[str, int]]:
    """(key, end token) of each sealed piece chained from `start`, from the store's metadata only
    (a piece's end is its chunks' last token); stops at a missing or unsealed one."""
    chain: list[tuple[str, int]] = []
    while True:
        key = piece_key(state_key, start)
        info = client.lookup(key)
        if info is None or not info.sealed or not info.chunks:
            return chain
        end = max(c.token_end for c in info.chunks)
        if end <= start:
            raise CorruptStateError(f"{key} ends at token {end}, not after {start}")
        chain.append((key, end))
        start = end
