"""MoE routing (DeepSeek-V3 / Kimi style): the torch reference and the one-launch kernel's dispatch.

Scores are `sigmoid(x @ W^T)` in fp32; the score-correction bias only steers the choice: groups are
ranked by the sum of their two best biased scores, the best `topk_group` groups kept, then the
`top_k` best biased experts among them chosen. Their weights are the unbiased scores, renormalised
to sum to 1 when asked, times the scaling factor. On CUDA (`fused_backend`) the whole router, the
fp32 matmul included, is one Triton launch (ops/router_triton.py) instead of ~17 torch ops. The
order of a token's choices is not part of the contract (the reference's `topk` is unsorted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.ops.triton_kernel import fused_backend, kernel_or_torch


@dataclass(frozen=True)
class RouterSpec:
    """How a layer routes: `top_k` of `num_experts`, grouped into `num_groups` of which `topk_group` stay."""

    num_experts: int
    top_k: int
    num_groups: int
    topk_group: int
    renormalize: bool
    scaling: float


def route_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, spec: RouterSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) for tokens x [T, H]; weight [E, H], bias [E] fp32."""
    scores = F.linear(x.float(), weight.float()).sigmoid()
    biased = scores + bias
    if spec.num_groups > 1:
        grouped = biased.view(-1, spec.num_groups, spec.num_experts // spec.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(spec.topk_group, dim=-1, sorted=False)[1], True)
        biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, spec.num_experts)
    expert_ids = biased.topk(spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, expert_ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.scaling, expert_ids


def with_shared(
    weights: torch.Tensor, ids: torch.Tensor, num_experts: int, num_shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The choices with `num_shared` more per token: ids `num_experts`.. (the shared experts, as the
    fused MoE kernels name them), weight 1."""
    if not num_shared:
        return weights, ids
    shared_ids = torch.arange(num_experts, num_experts + num_shared, device=ids.device).expand(
        ids.shape[0], -1
    )
    return torch.cat([weights, torch.ones_like(shared_ids, dtype=weights.dtype)], 1), torch.cat(
        [ids, shared_ids], 1
    )


def route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, spec: RouterSpec, num_shared: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_torch`'s choice and weights from the chosen backend, `with_shared` `num_shared` more."""

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        return with_shared(*route_torch(x, weight, bias, spec), spec.num_experts, num_shared)

    if fused_backend(x.device) == "torch":
        return reference()
    from splitserve.engine.ops.router_triton import route_triton

    return kernel_or_torch("moe_router", lambda: route_triton(x, weight, bias, spec, num_shared), reference)
