"""`ReplayPublish` <-> the layer states a store holds, and the keys a request's state lives under.

A decode worker that publishes keeps, in its node's store, for each request it decodes:

* `<state_key>`: the request's base state (the prompt's state the prefill handed off, MLA rows
  0..n and each KDA layer's conv and recurrent state at n; a resumed request's worker writes the
  one it resumed from),
* `<state_key>/replay/<token_start>`: the MLA rows of one `ReplayPublish`, named by the token its
  piece starts at. Pieces chain: the next one starts where this one ends (`num_tokens`), so a
  reader walks them from the prompt's end without listing anything. Every one is kept (the rows
  of every token are needed).
* `<state_key>/replay/<token_start>/kda`: the same publish's KDA part (conv states and records or
  a checkpoint). Once a piece with a checkpoint is written the KDA parts before it are released,
  so a request keeps at most about two checkpoints' worth of KDA bytes (replay_publish.py's rule).

A piece's states, in the handoff's own encoding (`state_codec`), with its token range in each
state's metadata:

* MLA KV rows [token_start, num_tokens) of each MLA layer (kind MLA_KV, numbered by token),
* each KDA layer's conv state at num_tokens (KDA_CONV, token range [token_start, num_tokens)),
* each KDA layer's recurrent part (KDA_RECURRENT): a checkpoint [H, Dk, Dv] is stored with token
  range [0, num_tokens) (a whole state); records are stored as one tensor [n, H, Dk + Dv + Dk]
  (k, u and the cumulative log-decay side by side) with range [token_start, num_tokens), and
  token_start > 0 always (a piece starts at or after the prompt's end), which tells them apart.

A tensor-parallel engine's KDA part holds each rank's share as states of their own naming their
heads (`LayerState.heads`, engine/parallel/heads.py); a reader assembles them (`whole_heads`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from splitserve.engine.parallel.heads import whole_heads
from splitserve.engine.replay_publish import ReplayLayerPiece, ReplayPublish
from splitserve.engine.state_transfer import LayerState
from splitserve.state import CorruptStateError, StateKind

REPLAY_INFIX = "/replay/"
KDA_SUFFIX = "/kda"


def piece_key(state_key: str, token_start: int) -> str:
    """The key of the publish of `state_key`'s request that starts at token `token_start`."""
    return f"{state_key}{REPLAY_INFIX}{token_start}"


def kda_key(state_key: str, token_start: int) -> str:
    """The key of the KDA part of the publish of `state_key`'s request that starts at `token_start`."""
    return f"{piece_key(state_key, token_start)}{KDA_SUFFIX}"


def publish_states(publish: ReplayPublish) -> list[LayerState]:
    """`publish` as layer states: `mla_states` then `kda_states` (tensors where they were: the
    caller moves them to the host)."""
    return mla_states(publish) + kda_states(publish)


def mla_states(publish: ReplayPublish) -> list[LayerState]:
    """The MLA rows of `publish`, as stored under its `piece_key`."""
    start, end = publish.token_start, publish.num_tokens
    return [LayerState(rows.layer_id, StateKind.MLA_KV, rows.tensor, start, end, end) for rows in publish.mla]


def kda_states(publish: ReplayPublish) -> list[LayerState]:
    """The KDA part of `publish` (conv, records or checkpoint), as stored under its `kda_key`."""
    start, end = publish.token_start, publish.num_tokens
    states = []
    for piece in publish.kda:
        lid, heads = piece.layer_id, piece.heads
        states.append(LayerState(lid, StateKind.KDA_CONV, piece.conv, start, end, heads=heads))
        if piece.checkpoint is not None:
            states.append(LayerState(lid, StateKind.KDA_RECURRENT, piece.checkpoint, 0, end, heads=heads))
        else:
            assert piece.k is not None and piece.u is not None and piece.g_cum is not None
            records = torch.cat([piece.k, piece.u, piece.g_cum], dim=-1)
            states.append(LayerState(lid, StateKind.KDA_RECURRENT, records, start, end, heads=heads))
    return states


def publish_from_states(
    request_id: str, states: Iterable[LayerState], head_dims: tuple[int, int]
) -> ReplayPublish:
    """The `ReplayPublish` stored as `states` (as `state_codec.decode_pieces` yields them: MLA rows
    may come in several pieces; a tensor-parallel engine's KDA parts as one piece per rank, each
    naming its heads: they are assembled into every head). `head_dims` is (Dk, Dv) of a KDA
    layer's recurrent state, to cut records apart. Raises CorruptStateError when the states do
    not make one piece."""
    dk, dv = head_dims
    rows: dict[int, list[LayerState]] = {}
    conv: dict[int, LayerState] = {}
    recurrent: dict[int, LayerState] = {}
    for state in whole_heads(states):
        if state.kind is StateKind.MLA_KV:
            rows.setdefault(state.layer_id, []).append(state)
        else:
            (conv if state.kind is StateKind.KDA_CONV else recurrent)[state.layer_id] = state
    if not conv or conv.keys() != recurrent.keys():
        raise CorruptStateError(
            f"replay piece of {request_id}: KDA layers with a conv state {sorted(conv)} and with a "
            f"recurrent one {sorted(recurrent)} differ"
        )
    first = next(iter(conv.values()))
    start, end = first.token_start, first.token_end
    if any((c.token_start, c.token_end) != (start, end) for c in conv.values()):
        raise CorruptStateError(f"replay piece of {request_id}: KDA layers cover different tokens")
    kda = []
    for lid, part in sorted(conv.items()):
        piece = ReplayLayerPiece(lid, part.tensor)
        state = recurrent[lid]
        if state.token_start == 0:
            piece.checkpoint = state.tensor
        elif (state.token_start, state.token_end, state.tensor.shape[-1]) == (start, end, 2 * dk + dv):
            piece.k, piece.u, piece.g_cum = torch.split(state.tensor, [dk, dv, dk], dim=-1)
        else:
            raise CorruptStateError(
                f"replay piece {start}..{end} of {request_id}: layer {lid}'s records cover "
                f"{state.token_start}..{state.token_end} with shape {tuple(state.tensor.shape)}"
            )
        kda.append(piece)
    mla = [_joined(lid, parts, start, end, request_id) for lid, parts in sorted(rows.items())]
    return ReplayPublish(request_id, start, end, kda, mla)


def mla_rows_from_states(
    request_id: str, states: Iterable[LayerState], start: int, end: int
) -> list[LayerState]:
    """Each MLA layer's rows [start, end) stored as `states` (a piece's `mla_states`, possibly in
    several parts), one state per layer. Raises CorruptStateError when they are anything else."""
    rows: dict[int, list[LayerState]] = {}
    for state in states:
        if state.kind is not StateKind.MLA_KV:
            raise CorruptStateError(
                f"replay piece {start}..{end} of {request_id} holds a {state.kind} state where MLA rows belong"
            )
        rows.setdefault(state.layer_id, []).append(state)
    if not rows:
        raise CorruptStateError(f"replay piece {start}..{end} of {request_id} holds no MLA rows")
    return [_joined(lid, parts, start, end, request_id) for lid, parts in sorted(rows.items())]


def _joined(lid: int, parts: list[LayerState], start: int, end: int, request_id: str) -> LayerState:
    """One MLA layer's rows [start, end) as one state (a copy: the parts may be read-only views)."""
    parts = sorted(parts, key=lambda s: s.token_start)
    covered = [(p.token_start, p.token_end) for p in parts]
    edges = [start] + [e for _, e in covered]
    if [s for s, _ in covered] != edges[:-1] or edges[-1] != end:
        raise CorruptStateError(
            f"replay piece {start}..{end} of {request_id}: MLA layer {lid}'s rows cover {covered}"
        )
    tensor = torch.cat([p.tensor for p in parts]) if len(parts) > 1 else parts[0].tensor.clone()
    return LayerState(lid, StateKind.MLA_KV, tensor, start, end, end)
