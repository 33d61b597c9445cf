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

MLA_KV = "mla_kv"
KDA_CONV = "kda_conv"
KDA_RECURRENT = "kda_recurrent"
STATE_KINDS = (MLA_KV, KDA_CONV, KDA_RECURRENT)


@dataclass(frozen=True)
class LayerState:
    """One tensor of one layer of one request's state, with the token range it covers."""

    layer_id: int
    kind: str
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
        return [LayerState(layer_id, MLA_KV, kv, 0, num_tokens)]
    return [
        LayerState(layer_id, KDA_CONV, caches.kda_conv[layer_id][slot].cpu().clone(), 0, num_tokens),
        LayerState(
            layer_id, KDA_RECURRENT, caches.kda_recurrent[layer_id][slot].cpu().clone(), 0, num_tokens
        ),
    ]


def write_layer(caches: LayerCaches, state: LayerState, rows: torch.Tensor, slot: int) -> None:
    """Scatter one received layer state into reserved rows / slot; shapes and dtypes must match."""
    if state.kind == MLA_KV:
        target = caches.mla_kv.get(state.layer_id)
        expected: tuple[int, ...] = (len(rows), *target.shape[1:]) if target is not None else ()
    elif state.kind == KDA_CONV:
        target = caches.kda_conv.get(state.layer_id)
        expected = tuple(target.shape[1:]) if target is not None else ()
    elif state.kind == KDA_RECURRENT:
        target = caches.kda_recurrent.get(state.layer_id)
        expected = tuple(target.shape[1:]) if target is not None else ()
    else:
        raise ValueError(f"unknown state kind {state.kind!r}; expected one of {STATE_KINDS}")
    if target is None:
        raise ValueError(f"layer {state.layer_id} has no {state.kind} cache in this model")
    if tuple(state.tensor.shape) != expected:
        raise ValueError(
            f"layer {state.layer_id} {state.kind}: got shape {tuple(state.tensor.shape)}, expected {expected}"
        )
    if state.tensor.dtype != target.dtype:
        raise ValueError(
            f"layer {state.layer_id} {state.kind}: got {state.tensor.dtype}, this engine caches {target.dtype}; "
            "prefill and decode pools must run the same dtype"
        )
    value = state.tensor.to(target.device)
    if state.kind == MLA_KV:
        target[rows.to(target.device)] = value
    else:
        target[slot] = value
