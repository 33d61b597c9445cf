"""Rebuild a decoding request's state from its prompt state and the `ReplayPublish` pieces after it.

The inverse of engine/replay_publish.py: start from the prompt's state (every MLA layer's rows
0..n and every KDA layer's conv and recurrent state at n, as the prefill handed it off), then for
each piece in order append its MLA rows, take its conv state, and advance each KDA layer's
recurrent state: fold the piece's records into it (`rebuild`, the very function the publisher's
engine folded with), or take its checkpoint. The result is an `ImportedPrefix` of the request's
first `num_tokens` tokens (prompt + generated); the tokens generated after it are recomputed by the
resuming engine from `output_token_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.ops.replay_ssm import rebuild
from splitserve.engine.prefix_cache.imported import ImportedPrefix
from splitserve.engine.replay_publish import ReplayPublish
from splitserve.engine.state_transfer import LayerState
from splitserve.state import StateKind


def resume_states(
    prompt_states: Sequence[LayerState], pieces: Sequence[ReplayPublish]
) -> tuple[int, list[LayerState]]:
    """The state after the last piece that continues the prompt state: (num_tokens, states).

    Raises ValueError when a piece leaves a gap, or its records extend a state that is not the one
    rebuilt so far (a checkpoint piece may overlap: its rows before the current end are skipped).
    """
    kda = [s for s in prompt_states if s.kind is not StateKind.MLA_KV]
    if not kda:
        raise ValueError("the prompt state has no KDA layer state: it cannot be resumed from")
    num_tokens = kda[0].token_end
    conv = {s.layer_id: s.tensor for s in kda if s.kind is StateKind.KDA_CONV}
    recurrent = {s.layer_id: s.tensor for s in kda if s.kind is StateKind.KDA_RECURRENT}
    mla = [s for s in prompt_states if s.kind is StateKind.MLA_KV]
    for piece in pieces:
        if piece.num_tokens <= num_tokens:
            continue  # already covered
        has_records = any(p.k is not None for p in piece.kda)
        if piece.token_start > num_tokens or (has_records and piece.token_start != num_tokens):
            raise ValueError(
                f"publish {piece.token_start}..{piece.num_tokens} of {piece.request_id} does not continue the "
                f"state rebuilt to {num_tokens} tokens: a piece is missing; re-prefill instead"
            )
        skip = num_tokens - piece.token_start
        for rows in piece.mla:
            mla.append(LayerState(rows.layer_id, rows.kind, rows.tensor[skip:], num_tokens, rows.token_end))
        for layer in piece.kda:
            conv[layer.layer_id] = layer.conv
            if layer.checkpoint is not None:
                recurrent[layer.layer_id] = layer.checkpoint
            else:
                assert layer.k is not None and layer.u is not None and layer.g_cum is not None
                state = recurrent[layer.layer_id].to(layer.k.device).unsqueeze(0)
                k, u, g_cum = (t.unsqueeze(0) for t in (layer.k, layer.u, layer.g_cum))
                recurrent[layer.layer_id] = rebuild(state, k, u, g_cum, layer.k.shape[0])[0]
        num_tokens = piece.num_tokens
    states = [_ending(s, num_tokens) for s in mla]
    for lid in conv:
        states.append(LayerState(lid, StateKind.KDA_CONV, conv[lid], 0, num_tokens))
        states.append(LayerState(lid, StateKind.KDA_RECURRENT, recurrent[lid], 0, num_tokens))
    return num_tokens, states


def _ending(rows: LayerState, num_tokens: int) -> LayerState:
    """`rows` as a piece of a state of `num_tokens` tokens."""
    return LayerState(rows.layer_id, rows.kind, rows.tensor, rows.token_start, rows.token_end, num_tokens)


def imported_prefix_from_replay(
    prompt_states: Sequence[LayerState],
    pieces: Sequence[ReplayPublish],
    hash_chain: list[bytes] | None = None,
) -> ImportedPrefix:
    """`resume_states` as an `ImportedPrefix` (its hash chain: the units it covers, if the caller names them)."""
    num_tokens, states = resume_states(prompt_states, pieces)
    return ImportedPrefix(num_tokens=num_tokens, hash_chain=list(hash_chain or []), states=states)


def stack_mla_rows(states: Sequence[LayerState]) -> dict[int, torch.Tensor]:
    """Each MLA layer's rows 0..n as one tensor (pieces in token order), for checks and tests."""
    by_layer: dict[int, list[LayerState]] = {}
    for s in states:
        if s.kind is StateKind.MLA_KV:
            by_layer.setdefault(s.layer_id, []).append(s)
    return {
        lid: torch.cat([p.tensor for p in sorted(pieces, key=lambda p: p.token_start)])
        for lid, pieces in by_layer.items()
    }
