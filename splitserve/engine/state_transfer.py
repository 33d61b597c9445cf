"""Moving one request's state out of and into an engine's caches, piece by piece.

A prompt's state is, per MLA layer, the latent KV rows of its tokens ([L, rank + rope]) and, per
KDA layer, the conv window and recurrent state of its slot. MLA rows are final as soon as the
chunk that computed them has run that layer, so they ship chunk by chunk (`extract_mla_rows`,
one token range per piece); KDA states are final only after the prompt's last chunk
(`extract_kda`). `write_piece` scatters a piece into the rows and slot a receiving engine
reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.state import HeadRange, StateKind


@dataclass(frozen=True)
class LayerState:
    """One tensor of one layer of one request's state, with the token range it covers.

    MLA KV pieces cover [token_start, token_end) of a prompt of `num_prompt_tokens` tokens (a
    prompt's rows may come in several pieces); KDA states cover the whole prompt. The tensor may
    live on the engine's device: whoever encodes it copies it to the host, off the engine thread.
    """

    layer_id: int
    kind: StateKind
    tensor: torch.Tensor
    token_start: int
    token_end: int
    num_prompt_tokens: int | None = None  # None: token_end (the piece ends the prompt)
    # a tensor-parallel rank's share of a KDA state's heads (engine/parallel/heads.py); None: every head
    heads: HeadRange | None = None

    @property
    def prompt_len(self) -> int:
        return self.token_end if self.num_prompt_tokens is None else self.num_prompt_tokens

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def token_rows(block_table: list[int], num_tokens: int, block_size: int, start: int = 0) -> torch.Tensor:
    """KV pool rows holding positions [start, num_tokens) of a request, in order."""
    positions = torch.arange(start, num_tokens)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def state_bytes(caches: LayerCaches, num_tokens: int, num_ranks: int = 1) -> int:
    """Bytes of one request's whole state for a prompt of `num_tokens` tokens (what a writer
    can tell its store up front, so one region holds it all). `num_ranks`: the caches are one
    tensor-parallel rank's of so many, each exporting its share of the KDA heads."""
    mla = sum(kv.shape[1] * kv.element_size() * num_tokens for kv in caches.mla_kv.values())
    kda = sum(
        t[0].numel() * t.element_size() for t in (*caches.kda_conv.values(), *caches.kda_recurrent.values())
    )
    return mla + kda * num_ranks


def extract_mla_rows(
    caches: LayerCaches, layer_id: int, rows: torch.Tensor, token_start: int, num_prompt_tokens: int
) -> LayerState:
    """A copy of one MLA layer's KV `rows` (tokens [token_start, token_start + len(rows))).

    A gather on the cache's device: on CUDA it is queued behind the layer that wrote the rows and
    the engine thread never waits for it; the sender's `.cpu()` does, on its own thread.
    """
    kv = caches.mla_kv[layer_id]
    piece = kv.index_select(0, rows.to(kv.device))
    return LayerState(
        layer_id, StateKind.MLA_KV, piece, token_start, token_start + len(rows), num_prompt_tokens
    )


def extract_kda(caches: LayerCaches, layer_id: int, slot: int, num_tokens: int) -> list[LayerState]:
    """Copies (never views) of one KDA layer's conv and recurrent state after the prompt's last chunk."""
    if caches.replay is not None:
        caches.replay.flush(slot)  # with ReplaySSM rings the pool holds a checkpoint: make it the state
    conv = caches.kda_conv[layer_id][slot].clone()
    recurrent = caches.kda_recurrent[layer_id][slot].clone()
    return [
        LayerState(layer_id, StateKind.KDA_CONV, conv, 0, num_tokens),
        LayerState(layer_id, StateKind.KDA_RECURRENT, recurrent, 0, num_tokens),
    ]


def cache_for(caches: LayerCaches, state: LayerState) -> torch.Tensor:
    """The cache tensor `state` belongs in; raises ValueError if its shape or dtype do not fit."""
    kind = StateKind(state.kind)
    by_kind = {
        StateKind.MLA_KV: caches.mla_kv,
        StateKind.KDA_CONV: caches.kda_conv,
        StateKind.KDA_RECURRENT: caches.kda_recurrent,
    }
    target = by_kind[kind].get(state.layer_id)
    what = f"layer {state.layer_id} {kind.value}"
    if target is None:
        raise ValueError(f"{what}: this model has no such cache")
    num_rows = state.token_end - state.token_start
    expected = (num_rows, *target.shape[1:]) if kind is StateKind.MLA_KV else tuple(target.shape[1:])
    if tuple(state.tensor.shape) != expected:
        raise ValueError(f"{what}: got shape {tuple(state.tensor.shape)}, expected {expected}")
    if state.tensor.dtype != target.dtype:
        raise ValueError(
            f"{what}: got {state.tensor.dtype}, this engine caches {target.dtype}; "
            "prefill and decode pools must run the same dtype"
        )
    return target


def write_piece(caches: LayerCaches, state: LayerState, rows: torch.Tensor, slot: int) -> None:
    """Scatter one received piece into reserved room: MLA rows `rows[token_start:token_end]`
    (`rows` are all the prompt's rows), KDA states into `slot`. Checks shapes and dtypes first."""
    target = cache_for(caches, state)
    value = state.tensor.to(target.device, non_blocking=True)
    if state.kind is StateKind.MLA_KV:
        index = rows[state.token_start : state.token_end].to(target.device, non_blocking=True)
        target.index_copy_(0, index, value)
    else:
        target[slot].copy_(value)
