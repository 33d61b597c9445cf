"""Paged MLA attention in the latent space: the torch reference and the choice of backend.

Inputs are the same for every backend: `q_full` [T, H, rank + rope] (absorbed query, flat
tokens), the layer's KV pool [N, rank + rope] (one shared KV head per token: latent, then the
unrotated key part), and a `TokenGroup` naming, per row, the pool rows of its context
(`kv_index`) and the absolute position of each new token (`query_pos`, causal). The output,
`softmax(q . kv^T * scale) @ kv[:, :rank]` per head, is written to `out_latent[token_index]`.

On CUDA the Triton kernel (`paged_mla_triton`) reads the pool through `kv_index` directly;
elsewhere the torch reference gathers one copy of each row's context (shared by all heads, not
repeated per head) and runs torch's fused attention on it, with a per-row causal mask built
per query chunk from `query_pos`: no [rows, heads * tokens, context] score matrix exists.
`SPLITSERVE_MLA_BACKEND=torch|triton` overrides the choice (benchmarks, debugging).

`write_kv` puts a step's new tokens into the pool (the latent RMS-normalised, then the rope key
part): the torch reference's norm, concatenation and scatter, or one Triton launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.engine.forward_batch import TokenGroup
from splitserve.engine.ops.backend import choose_backend, importable
from splitserve.engine.ops.norms import rms_norm_torch
from splitserve.engine.ops.triton_kernel import kernel_or_torch

# The largest per-chunk attention mask the torch path builds ([rows, chunk, context], bool + fp32).
MASK_BUDGET_BYTES = 64 << 20
BACKEND_ENV = "SPLITSERVE_MLA_BACKEND"


def triton_available() -> bool:
    """Whether the `triton` package can be imported here (it is optional on CPU nodes)."""
    return importable("triton")


def mla_backend(device: torch.device) -> str:
    """`triton` on a CUDA device with triton installed, else `torch`; the env var overrides."""
    return choose_backend(BACKEND_ENV, "triton", triton_available(), "pip install triton", device)


def write_kv_torch(
    kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`kv_pool[slot_mapping] = [rms_norm(latent), k_rope]` for kv [T, rank + rope] = (latent, k_rope)."""
    latent, k_rope = kv.split([norm_weight.shape[0], kv.shape[1] - norm_weight.shape[0]], dim=-1)
    kv_pool[slot_mapping] = torch.cat([rms_norm_torch(latent, norm_weight, eps), k_rope], dim=-1)


def write_kv(
    kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`write_kv_torch` by the chosen backend."""
    if mla_backend(kv_pool.device) == "torch":
        return write_kv_torch(kv, norm_weight, eps, kv_pool, slot_mapping)
    from splitserve.engine.ops.paged_mla_triton import write_kv_triton

    kernel_or_torch(
        "mla_write_kv",
        lambda: write_kv_triton(kv, norm_weight, eps, kv_pool, slot_mapping),
        lambda: write_kv_torch(kv, norm_weight, eps, kv_pool, slot_mapping),
    )


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
    """The CPU reference: `scaled_dot_product_attention` over each row's gathered context.

    The values are the keys' first `rank` columns, so attention runs with `v = k` (every head
    dim rank + rope, which the fused CPU kernel needs) and keeps the output's first `rank`
    columns: the same weighted sum, with no separate value tensor. The single KV head is
    expanded over the query heads as a stride-0 view (no copy). The fused kernel never holds
    the scores (one online-softmax pass instead of bmm, scale, mask fill, softmax, bmm over a
    [rows, heads * num, context] matrix); only the boolean mask [rows, num, context] is built,
    shared by the heads, per query chunk within `mask_budget_bytes`.
    """
    rows, length, heads = group.num_rows, group.max_len, q_full.shape[1]
    # [B, K, rank + rope]: one copy, shared by all heads (index_select: the fast CPU row gather)
    keys = kv_pool.index_select(0, group.kv_index.view(-1)).view(rows, -1, kv_pool.shape[1])
    context = keys.shape[1]
    keys = keys.unsqueeze(1).expand(rows, heads, context, keys.shape[-1])  # [B, H, K, D], a view
    positions = torch.arange(context, device=kv_pool.device)
    query_pos = group.query_pos
    # the mask [B, 1, num, K] is bool, and the kernel turns it into an additive fp32 one (5 bytes)
    chunk = max(1, min(length, mask_budget_bytes // max(1, rows * context * 5)))
    for start in range(0, length, chunk):
        stop = min(length, start + chunk)
        q = q_full[group.token_index[:, start:stop]].transpose(1, 2)  # [B, H, num, D]
        if chunk == length > 1:  # one chunk: every MLA layer of the step shares its additive mask
            mask = _shared_mask(group, positions, q.dtype)
        else:
            mask = (positions.view(1, 1, -1) <= query_pos[:, start:stop].unsqueeze(-1)).unsqueeze(1)
        o = F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask, scale=scale)
        o = o[..., :rank].transpose(1, 2)  # [B, num, H, rank]
        if stop - start == length == 1:
            out_latent[group.token_index[:, 0]] = o[:, 0]
            continue
        valid = group.valid[:, start:stop]
        out_latent[group.token_index[:, start:stop][valid]] = o[valid]


def _shared_mask(group: TokenGroup, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The group's additive causal mask [B, 1, L, K] (0 where visible, -inf elsewhere), built by
    the step's first MLA layer and kept on the group for the others: the kernel then neither
    compares positions nor converts a boolean mask per layer (~1 ms a layer at 257 x 1.4k)."""
    key = ("mla_additive_mask", dtype, positions.numel())
    mask = group.derived.get(key)
    if mask is None:
        hidden = positions.view(1, 1, -1) > group.query_pos.unsqueeze(-1)  # [B, L, K]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
            hidden, float("-inf")
        )
        mask = group.derived[key] = mask.unsqueeze(1)
    return mask
