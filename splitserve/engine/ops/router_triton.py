"""The MoE router as one Triton launch (reference: ops/router.py `route_torch`).

One program owns `BLOCK_T` tokens and every expert: it computes their fp32 logits (an IEEE fp32 dot,
so the choice is as exact as torch's fp32 matmul, never TF32), the sigmoid scores and biased scores,
ranks the groups by their two best biased scores and keeps the best `topk_group`, picks the `top_k`
best biased experts left (in descending order; the lowest id among equal scores), and writes their
unbiased scores, renormalised and scaled, with their ids. No host sync: a CUDA graph can hold it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.ops.router import RouterSpec
from splitserve.engine.ops.triton_kernel import TritonKernel


def _router_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    hidden,
    stride_x,
    stride_w,
    scaling,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < NUM_EXPERTS
    logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < hidden
        x = tl.load(
            x_ptr + tokens[:, None] * stride_x + offs_h[None, :],
            mask=t_ok[:, None] & h_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + experts[None, :] * stride_w + offs_h[:, None],
            mask=h_ok[:, None] & e_ok[None, :],
            other=0.0,
        )
        logits = tl.dot(x.to(tl.float32), w.to(tl.float32), logits, input_precision="ieee")
    scores = tl.sigmoid(logits)
    biased = scores + tl.load(bias_ptr + experts, mask=e_ok, other=0.0)[None, :]
    biased = tl.where(e_ok[None, :], biased, float("-inf"))
    if NUM_GROUPS > 1:
        group_of = (experts // (NUM_EXPERTS // NUM_GROUPS))[None, :]
        groups = tl.arange(0, BLOCK_G)[None, :]
        group_scores = tl.full([BLOCK_T, BLOCK_G], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(NUM_GROUPS):  # a group's score: the sum of its two best biased scores
            mine = tl.where(group_of == g, biased, float("-inf"))
            best = tl.argmax(mine, axis=1)
            second = tl.max(tl.where(experts[None, :] == best[:, None], float("-inf"), mine), axis=1)
            group_scores = tl.where(groups == g, (tl.max(mine, axis=1) + second)[:, None], group_scores)
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(group_scores, axis=1)[:, None]
            keep = keep | (group_of == best)
            group_scores = tl.where(groups == best, float("-inf"), group_scores)
        biased = tl.where(keep, biased, float("-inf"))
    choices = tl.arange(0, BLOCK_K)[None, :]
    chosen_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    chosen_weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(biased, axis=1)
        hit = experts[None, :] == best[:, None]
        weight = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        chosen_ids = tl.where(choices == j, best[:, None].to(tl.int64), chosen_ids)
        chosen_weights = tl.where(choices == j, weight[:, None], chosen_weights)
        biased = tl.where(hit, float("-inf"), biased)
    if RENORMALIZE:
        chosen_weights = chosen_weights / (tl.sum(chosen_weights, axis=1)[:, None] + 1e-20)
    chosen_weights = chosen_weights * scaling
    if NUM_SHARED > 0:  # then the shared experts, weight 1
        shared = choices >= TOP_K
        chosen_ids = tl.where(shared, (NUM_EXPERTS - TOP_K + choices).to(tl.int64), chosen_ids)
        chosen_weights = tl.where(shared, 1.0, chosen_weights)
    out = tokens[:, None] * (TOP_K + NUM_SHARED) + choices
    ok = t_ok[:, None] & (choices < TOP_K + NUM_SHARED)
    tl.store(ids_ptr + out, chosen_ids, mask=ok)
    tl.store(weights_ptr + out, chosen_weights, mask=ok)


_KERNEL = TritonKernel("moe_router", _router_kernel)
BLOCK_T = 16


def route_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, spec: RouterSpec, num_shared: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `route_torch` then `with_shared` (ops/router.py); the routed choices come in
    descending biased score."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == weight.stride(1) == 1 and bias.is_contiguous()
    width = spec.top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int64, device=x.device)
    if num_tokens:
        _KERNEL[(triton.cdiv(num_tokens, BLOCK_T),)](
            x,
            weight,
            bias,
            weights,
            ids,
            num_tokens,
            hidden,
            x.stride(0),
            weight.stride(0),
            spec.scaling,
            NUM_EXPERTS=spec.num_experts,
            TOP_K=spec.top_k,
            NUM_SHARED=num_shared,
            NUM_GROUPS=spec.num_groups,
            TOPK_GROUP=spec.topk_group,
            RENORMALIZE=spec.renormalize,
            BLOCK_T=BLOCK_T,
            BLOCK_E=max(16, triton.next_power_of_2(spec.num_experts)),
            BLOCK_H=32,
            BLOCK_G=max(2, triton.next_power_of_2(spec.num_groups)),
            BLOCK_K=max(2, triton.next_power_of_2(width)),
            num_warps=4,
        )
    return weights, ids


def warm_up(
    weight: torch.Tensor,
    bias: torch.Tensor,
    spec: RouterSpec,
    num_shared: int,
    dtype: torch.dtype,
    num_rows: int,
) -> None:
    """Launch the router once for `num_rows` tokens in `dtype`, with these weights."""
    x = torch.zeros(num_rows, weight.shape[1], dtype=dtype, device=weight.device)
    route_triton(x, weight, bias, spec, num_shared)
