"""Reads a lost decode worker's stored state of one request and rebuilds it for this worker to resume.

The lost worker kept, in its node's store, the request's base state under `state_key` and a
chain of ReplaySSM publishes after it, each as its MLA rows and its KDA part under two keys
(keys and encoding: engine/replay_codec.py); the KDA parts before the newest checkpoint are
released as it decodes. This walks the chain of MLA rows from the prompt's end, piece after
piece (store metadata only), and stops at the first piece that is missing, still being written
(not sealed), or that would cover a token the client never received (the resumed state must end
before the last token sent: that token is the one the resumed engine computes from). Then it
looks up KDA parts from the newest piece back to the newest checkpoint, and rebuilds from that
checkpoint (or from the base's KDA state at the prompt's end) through the records after it, as
far as they reach without a gap; when a KDA part it needs is unreadable it falls back to the
checkpoint before. `resume_states` rebuilds the state; the tokens sent after it (fewer than
`replay_window` when every publish landed) are recomputed by the resuming engine.

Errors say why the stored state cannot be used; the gateway then re-prefills instead:
`StateUnavailableError` (the base state is gone), `CorruptStateError` (a piece does not decode or
does not continue the chain), other `StateStoreError`s (the store failed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from splitserve.engine.parallel.heads import whole_heads
from splitserve.engine.replay_codec import kda_key, mla_rows_from_states, piece_key, publish_from_states
from splitserve.engine.replay_publish import ReplayPublish
from splitserve.engine.replay_resume import resume_states
from splitserve.engine.state_codec import decode, decode_pieces
from splitserve.engine.state_transfer import LayerState
from splitserve.state import CorruptStateError, StateKind
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import StateUnavailableError

logger = logging.getLogger(__name__)

CHECKPOINT, RECORDS = "checkpoint", "records"


@dataclass
class StoredState:
    """A request's state rebuilt from a store: `states` cover its first `num_tokens` tokens
    (prompt + that many generated); `prompt_states` is the base it was rebuilt from; `keys` are
    what was read (the caller releases them once the state is in)."""

    num_tokens: int
    states: list[LayerState]
    prompt_states: list[LayerState]
    keys: list[str]
    num_pieces: int  # stored pieces the state covers (read: only from the checkpoint used on)
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
    # a tensor-parallel prefill's KDA shares name their heads: rebuilt whole, re-sharded on the way in
    prompt_states = whole_heads(decode(client.get(state_key, timeout_s=timeout_s)))
    recurrent = [s for s in prompt_states if s.kind is StateKind.KDA_RECURRENT]
    if not recurrent or any(s.token_end != num_prompt_tokens for s in recurrent):
        raise CorruptStateError(
            f"stored state {state_key} does not end at the prompt's {num_prompt_tokens} tokens "
            f"({[s.token_end for s in recurrent]})"
        )
    head_dims = (int(recurrent[0].tensor.shape[-2]), int(recurrent[0].tensor.shape[-1]))
    limit = num_prompt_tokens + num_sent_tokens - 1
    spans = _chain(client, state_key, num_prompt_tokens)
    usable = [span for span in spans if span[2] <= limit]  # ends grow: a prefix of the chain
    kinds = _kda_kinds(client, state_key, spans)
    keys = [state_key] + [key for key, _, _ in spans] + [kda_key(state_key, s) for s in kinds]
    reader = _Reader(client, state_key, request_id, head_dims, timeout_s)
    for base, reach in _plans(usable, kinds):
        try:
            pieces = reader.pieces(num_prompt_tokens, usable, base, reach)
        except (CorruptStateError, StateUnavailableError) as exc:
            if not reader.kda_failed:
                raise
            logger.info(
                "stored KDA state of %s unreadable (%s); trying an earlier checkpoint", request_id, exc
            )
            continue
        try:
            num_tokens, states = resume_states(prompt_states, pieces)
        except ValueError as exc:
            raise CorruptStateError(str(exc)) from exc
        num_bytes = sum(s.num_bytes for s in prompt_states) + reader.num_bytes
        return StoredState(num_tokens, states, prompt_states, keys, reach, num_bytes)
    raise AssertionError("unreachable: the base plan reads no KDA part")


def _chain(client: StateStoreClient, state_key: str, start: int) -> list[tuple[str, int, int]]:
    """(key, start token, end token) of each sealed MLA piece chained from `start`, from the
    store's metadata only (a piece's end is its chunks' last token); stops at a missing or unsealed one."""
    chain: list[tuple[str, int, int]] = []
    while True:
        key = piece_key(state_key, start)
        info = client.lookup(key)
        if info is None or not info.sealed or not info.chunks:
            return chain
        end = max(c.token_end for c in info.chunks)
        if end <= start:
            raise CorruptStateError(f"{key} ends at token {end}, not after {start}")
        chain.append((key, start, end))
        start = end


def _kda_kinds(client: StateStoreClient, state_key: str, spans: list[tuple[str, int, int]]) -> dict[int, str]:
    """{piece start: CHECKPOINT | RECORDS} of the sealed KDA parts, looked up from the newest
    piece back to and including every checkpoint until one before which nothing is left (the
    publisher released them); metadata only. A checkpoint's recurrent chunks cover [0, end)."""
    kinds: dict[int, str] = {}
    for _, start, _ in reversed(spans):
        info = client.lookup(kda_key(state_key, start))
        if info is None or not info.sealed or not info.chunks:
            if any(k == CHECKPOINT for k in kinds.values()):
                break  # released before a checkpoint we have: the rest is gone too
            continue
        recurrent = [c for c in info.chunks if c.kind is StateKind.KDA_RECURRENT]
        kinds[start] = CHECKPOINT if recurrent and all(c.token_start == 0 for c in recurrent) else RECORDS
    return kinds


def _plans(usable: list[tuple[str, int, int]], kinds: dict[int, str]) -> list[tuple[int, int]]:
    """(base, reach) index pairs to try, best first: rebuild from piece `base`'s checkpoint (-1:
    the base state's at the prompt's end) through the KDA parts of pieces base+1..reach-1, all
    present; `reach` the number of pieces covered. The furthest reach first, the newest base on a tie."""
    plans = []
    for base in [i for i, (_, s, _) in enumerate(usable) if kinds.get(s) == CHECKPOINT] + [-1]:
        reach = base + 1
        while reach < len(usable) and usable[reach][1] in kinds:
            reach += 1
        plans.append((base, reach))
    return sorted(plans, key=lambda p: (-p[1], -p[0]))


class _Reader:
    """Reads a stored chain's pieces (each at most once), counting bytes; `kda_failed` says
    whether the last failure was a KDA part's (another plan may avoid it) or MLA rows' (none can)."""

    def __init__(
        self,
        client: StateStoreClient,
        state_key: str,
        request_id: str,
        head_dims: tuple[int, int],
        timeout_s: float,
    ) -> None:
        self.client, self.state_key, self.request_id = client, state_key, request_id
        self.head_dims, self.timeout_s = head_dims, timeout_s
        self.num_bytes = 0
        self.kda_failed = False
        self._rows: dict[int, list[LayerState]] = {}

    def pieces(
        self, num_prompt_tokens: int, usable: list[tuple[str, int, int]], base: int, reach: int
    ) -> list[ReplayPublish]:
        """The pieces that rebuild the state from the prompt's end through `usable[:reach]`: one
        spanning the prompt's end to piece `base`'s end (every MLA row, `base`'s checkpoint), then
        one per piece after it."""
        self.kda_failed = False
        rows = [self._mla(key, s, e) for key, s, e in usable[:reach]]
        pieces: list[ReplayPublish] = []
        if base >= 0:
            checkpoint = self._kda(usable[base][1], usable[base][2])
            joined = [_cat(layer) for layer in zip(*rows[: base + 1], strict=True)]
            pieces.append(
                ReplayPublish(
                    self.request_id, num_prompt_tokens, checkpoint.num_tokens, checkpoint.kda, joined
                )
            )
        for i in range(base + 1, reach):
            piece = self._kda(usable[i][1], usable[i][2])
            piece.mla = rows[i]
            pieces.append(piece)
        return pieces

    def _mla(self, key: str, start: int, end: int) -> list[LayerState]:
        if start not in self._rows:
            states = list(decode_pieces(self.client.get(key, timeout_s=self.timeout_s)))
            self._rows[start] = mla_rows_from_states(self.request_id, states, start, end)
            self.num_bytes += sum(s.num_bytes for s in self._rows[start])
        return self._rows[start]

    def _kda(self, start: int, end: int) -> ReplayPublish:
        key = kda_key(self.state_key, start)
        try:
            chunks = self.client.get(key, timeout_s=self.timeout_s)
            piece = publish_from_states(self.request_id, decode_pieces(chunks), self.head_dims)
        except (CorruptStateError, StateUnavailableError):
            self.kda_failed = True
            raise
        if (piece.token_start, piece.num_tokens) != (start, end):
            self.kda_failed = True
            raise CorruptStateError(
                f"{key} covers tokens {piece.token_start}..{piece.num_tokens}, not {start}..{end}"
            )
        self.num_bytes += sum(p.num_bytes for p in piece.kda)
        return piece


def _cat(parts: tuple[LayerState, ...]) -> LayerState:
    """One MLA layer's rows of consecutive pieces as one state."""
    first, last = parts[0], parts[-1]
    tensor = torch.cat([p.tensor for p in parts]) if len(parts) > 1 else first.tensor
    return LayerState(first.layer_id, first.kind, tensor, first.token_start, last.token_end, last.token_end)
