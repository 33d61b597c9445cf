"""Paged MLA attention in the latent space: the torch reference and the choice of backend.

Inputs are the same for every backend: `q_full` [T, H, rank + rope] (absorbed query, flat
tokens), the layer's KV pool [N, rank + rope] (one shared KV head per token: latent, then the
unrotated key part), and a `TokenGroup` naming, per row, the pool rows of its context
(`kv_index`) and the absolute position of each new token (`query_pos`, causal). The output,
`softmax(q . kv^T * scale) @ kv[:, :rank]` per head, is written to `out_latent[token_index]`.

On CUDA the Triton kernel (`paged_mla_triton`) reads the pool through `kv_index` directly;
elsewhere the torch reference gathers one copy of each row's context (shared by all heads, not
repeated per head) and builds the causal mask per query chunk from `query_pos`, so no
[rows, heads * tokens, context] score matrix of the whole chunk exists at once.
`SPLITSERVE_MLA_BACKEND=torch|triton` overrides the choice (benchmarks, debugging).
"""

from __future__ import annotations

import torch

from splitserve.engine.forward_batch import TokenGroup
from splitserve.engine.ops.backend import choose_backend, importable

# The largest per-chunk score matrix the torch path builds ([rows, heads * chunk, context] fp32).
MASK_BUDGET_BYTES = 64 << 20
BACKEND_ENV = "SPLITSERVE_MLA_BACKEND"


def triton_available() -> bool:
    """Whether the `triton` package can be imported here (it is optional on CPU nodes)."""
    return importable("triton")


def mla_backend(device: torch.device) -> str:
    """`triton` on a CUDA device with triton installed, else `torch`; the env var overrides."""
    return choose_backend(BACKEND_ENV, "triton", triton_available(), "pip install triton", device)


def paged_mla_attention(
    q_full: torch.Tensor,
    kv_pool: torch.Tensor,
    group: TokenGroup,
    rank: int,
    scale: float,
    out_latent: torch.Tensor,
) -> None:
    """Attention of one token group, written into `out_latent` [T, H, rank] by the chosen backend."""
    if mla_backend(kv_pool.device) == "triton":
        from splitserve.engine.ops.paged_mla_triton import paged_mla_triton

        paged_mla_triton(q_full, kv_pool, group, rank, scale, out_latent)
    else:
        paged_mla_torch(q_full, kv_pool, group, rank, scale, out_latent)


def paged_mla_torch(
    q_full: torch.Tensor,
    kv_pool: torch.Tensor,
    group: TokenGroup,
    rank: int,
    scale: float,
    out_latent: torch.Tensor,
    mask_budget_bytes: int = MASK_BUDGET_BYTES,
) -> None:
    """The CPU reference: scores, mask and softmax by hand over each row's gathered context.

    Heads fold into the query axis (row = h * num + i), so the single KV head is one [K, D]
    matrix per row that every head's queries multiply in one bmm, with no copy per head; the
    causal mask is [rows, num, K] and broadcasts over the heads in place.
    """
    rows, length, heads = group.num_rows, group.max_len, q_full.shape[1]
    # [B, K, rank + rope]: one copy, shared by all heads (index_select: the fast CPU row gather)
    keys = kv_pool.index_select(0, group.kv_index.view(-1)).view(rows, -1, kv_pool.shape[1])
    keys_t = keys.transpose(1, 2)
    values = keys[..., :rank]
    context = keys.shape[1]
    positions = torch.arange(context, device=kv_pool.device)
    query_pos = group.query_pos
    chunk = max(1, min(length, mask_budget_bytes // max(1, rows * heads * context * 4)))
    for start in range(0, length, chunk):
        stop = min(length, start + chunk)
        num = stop - start
        q = q_full[group.token_index[:, start:stop]].transpose(1, 2).reshape(rows, heads * num, -1)
        scores = torch.bmm(q, keys_t).mul_(scale)  # [B, H * num, K]
        hidden = positions.view(1, 1, -1) > query_pos[:, start:stop].unsqueeze(-1)  # [B, num, K]
        scores.view(rows, heads, num, context).masked_fill_(hidden.unsqueeze(1), float("-inf"))
        o = torch.bmm(torch.softmax(scores, dim=-1), values)  # [B, H * num, rank]
        o = o.view(rows, heads, num, rank).transpose(1, 2)  # [B, num, H, rank]
        if num == length == 1:
            out_latent[group.token_index[:, 0]] = o[:, 0]
            continue
        valid = group.valid[:, start:stop]
        out_latent[group.token_index[:, start:stop][valid]] = o[valid]
