"""Moving one request's state out of and into an engine's caches, layer by layer.

A prompt's state is, per MLA layer, the latent KV rows of its tokens ([L, rank + rope]) and, per
KDA layer, the conv window and recurrent state of its slot. `extract_layer` copies one layer out
(called right after that layer ran the prompt's final chunk, so transfer overlaps the layers
still computing); `write_layer` scatters it into the rows and slot a receiving engine reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.state import StateKind


@dataclass(frozen=True)
class LayerState:
    """One tensor of one layer of one request's state, with the token range it covers."""

    layer_id: int
    kind: StateKind
    tensor: torch.Tensor
    token_start: int
    token_end: int


def token_rows(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """KV pool rows holding positions [0, num_tokens) of a request, in order."""
    positions = torch.arange(num_tokens)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def extract_layer(
    caches: LayerCaches, layer_id: int, rows: torch.Tensor, slot: int, num_tokens: int
) -> list[LayerState]:
    """Copies (never views) of one layer's state, safe to ship while the engine keeps running."""
    if layer_id in caches.mla_kv:
        kv = caches.mla_kv[layer_id][rows.to(caches.mla_kv[layer_id].device)].cpu()
        return [LayerState(layer_id, StateKind.MLA_KV, kv, 0, num_tokens)]
    conv = caches.kda_conv[layer_id][slot].cpu().clone()
    recurrent = caches.kda_recurrent[layer_id][slot].cpu().clone()
    return [
        LayerState(layer_id, StateKind.KDA_CONV, conv, 0, num_tokens),
        LayerState(layer_id, StateKind.KDA_RECURRENT, recurrent, 0, num_tokens),
    ]


def write_layer(caches: LayerCaches, state: LayerState, rows: torch.Tensor, slot: int) -> None:
    """Scatter one received layer state into reserved rows / slot; shapes and dtypes must match."""
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
    expected = (len(rows), *target.shape[1:]) if kind is StateKind.MLA_KV else tuple(target.shape[1:])
    if tuple(state.tensor.shape) != expected:
        raise ValueError(f"{what}: got shape {tuple(state.tensor.shape)}, expected {expected}")
    if state.tensor.dtype != target.dtype:
        raise ValueError(
            f"{what}: got {state.tensor.dtype}, this engine caches {target.dtype}; "
            "prefill and decode pools must run the same dtype"
        )
    value = state.tensor.to(target.device)
    if kind is StateKind.MLA_KV:
        target[rows.to(target.device)] = value
    else:
        target[slot] = value
