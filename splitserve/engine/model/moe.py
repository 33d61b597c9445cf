"""Mixture of experts: grouped sigmoid top-k routing with the score-correction bias, shared experts.

Routing follows transformers (and DeepSeek-V3): sigmoid scores in fp32; the bias only steers
the choice (groups ranked by the sum of their top-2 biased scores, `topk_group` groups kept,
then top-k experts among them); weights are the unbiased scores of the chosen experts,
renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model.layers import GatedMLP
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.ops.fused_moe import fused_moe, moe_backend
from splitserve.engine.ops.moe_reference import moe_experts_torch


class TopKRouter(nn.Module):
    """Owns the fp32 router weight and bias; returns (weights [T, k], expert ids [T, k])."""

    def __init__(self, config: KimiLinearModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.n_group
        self.topk_group = config.topk_group
        self.renormalize = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias
        if self.num_groups > 1:
            grouped = biased.view(-1, self.num_groups, self.num_experts // self.num_groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False)[1], True)
            biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)
        expert_ids = biased.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, expert_ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, expert_ids


class Experts(nn.Module):
    """Routed experts as stacked weights: `w13` [E, 2I, H] (gate; up) and `w2` [E, H, I].

    On CUDA with triton installed the fused Triton kernel runs; elsewhere the torch reference
    (`SPLITSERVE_MOE_BACKEND=torch|triton` forces either).
    """

    def __init__(self, config: KimiLinearModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.moe_intermediate_size
        self.w13 = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.zeros(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if moe_backend(x.device) == "triton":
            return fused_moe(x, self.w13, self.w2, weights, expert_ids)
        return moe_experts_torch(x, self.w13, self.w2, weights, expert_ids)


class SparseMoE(nn.Module):
    """Routed experts plus always-on shared experts, summed."""

    def __init__(self, config: KimiLinearModelConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.shared_experts = GatedMLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        return self.experts(x, weights, expert_ids) + self.shared_experts(x)
