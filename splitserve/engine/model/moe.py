"""Mixture of experts: grouped sigmoid top-k routing with the score-correction bias, shared experts.

Routing follows transformers (and DeepSeek-V3), see ops/router.py: sigmoid scores in fp32; the bias
only steers the choice (groups ranked by the sum of their top-2 biased scores, `topk_group` groups
kept, then top-k experts among them); weights are the unbiased scores of the chosen experts,
renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.model.layers import GatedMLP
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.ops.fused_moe import SharedExperts, fused_moe, moe_backend
from splitserve.engine.ops.moe_reference import moe_experts_torch
from splitserve.engine.ops.router import RouterSpec, route
from splitserve.engine.ops.triton_kernel import kernel_or_torch
from splitserve.engine.parallel.group import SINGLE, TensorParallel
from splitserve.engine.parallel.shard import set_shard


class TopKRouter(nn.Module):
    """Owns the fp32 router weight and bias; returns (weights [T, k], expert ids [T, k]) (ops/router.py;
    one Triton launch on CUDA)."""

    def __init__(self, config: KimiLinearModelConfig) -> None:
        super().__init__()
        self.spec = RouterSpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            num_groups=config.n_group,
            topk_group=config.topk_group,
            renormalize=config.norm_topk_prob,
            scaling=config.routed_scaling_factor,
        )
        self.weight = nn.Parameter(
            torch.zeros(config.num_local_experts, config.hidden_size, dtype=torch.float32)
        )
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(config.num_local_experts, dtype=torch.float32)
        )

    def forward(self, x: torch.Tensor, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed choices, then `num_shared` shared experts (ids E.., weight 1) for the fused MoE."""
        return route(x, self.weight, self.e_score_correction_bias, self.spec, num_shared)


class Experts(nn.Module):
    """Routed experts as stacked weights: `w13` [E, 2I, H] (gate; up) and `w2` [E, H, I].

    On CUDA with triton installed the fused Triton kernel runs; elsewhere the torch reference
    (`SPLITSERVE_MOE_BACKEND=torch|triton` forces either). Under tensor parallelism a rank keeps
    every expert's share of the intermediate columns; with expert parallelism instead whole experts
    `first_expert..` (E / ranks of them) and computes only the choices that name them: every rank
    holds every token (attention is tensor parallel), so dispatch moves nothing and the combine is
    the sublayer's all-reduce.
    """

    def __init__(self, config: KimiLinearModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.moe_intermediate_size
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        if self.expert_parallel:
            e = tp.split(e, "num_local_experts (expert_parallel)")
        else:
            i = tp.split(i, "moe_intermediate_size")
        self.first_expert = tp.rank * e if self.expert_parallel else 0
        self.w13 = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.zeros(e, h, i))
        set_shard(self.w13, tp.expert_shard(1, parts=2))
        set_shard(self.w2, tp.expert_shard(2))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.local_choices(weights, expert_ids)
        elsewhere = self.expert_parallel
        if moe_backend(x.device) == "triton":
            return kernel_or_torch(
                "moe_grouped_gemm",
                lambda: fused_moe(x, self.w13, self.w2, weights, expert_ids, some_elsewhere=elsewhere),
                lambda: moe_experts_torch(x, self.w13, self.w2, weights, expert_ids),
            )
        return moe_experts_torch(x, self.w13, self.w2, weights, expert_ids)

    def local_choices(
        self, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With expert parallelism: the choices renumbered to this rank's experts, those of other
        ranks' experts as id E (the number here: "elsewhere") with weight 0; else unchanged."""
        if not self.expert_parallel:
            return weights, expert_ids
        num_here = self.w13.shape[0]
        local = expert_ids - self.first_expert
        here = (local >= 0) & (local < num_here)
        return weights.masked_fill(~here, 0), local.masked_fill(~here, num_here)


class SparseMoE(nn.Module):
    """Routed experts plus always-on shared experts, summed.

    With the fused MoE kernels the shared MLP runs inside them, as `n_shared_experts` more experts
    every token takes with weight 1 (its intermediate slices; the router appends them): the layer's
    MoE is four launches (router, alignment, two grouped GEMMs) and the sum of each token's rows.
    """

    def __init__(self, config: KimiLinearModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.gate = TopKRouter(config)  # every rank routes every token: the same choices everywhere
        self.experts = Experts(config, tp)
        self.num_shared = config.n_shared_experts
        self.shared_experts = GatedMLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, tp
        )
        # the fused kernels run the shared MLP as experts of the routed width: under tensor parallelism
        # both are cut by the ranks alike; with expert parallelism the routed experts stay whole and the
        # shared MLP (still cut) runs apart
        self.fuse_shared = bool(self.num_shared) and not self.experts.expert_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.shared_experts.gate_up  # fused at load
        if moe_backend(x.device) == "triton" and self.fuse_shared and gate_up is not None:
            shared = SharedExperts(gate_up, self.shared_experts.down_proj.weight, self.num_shared)

            def fused() -> torch.Tensor:
                weights, expert_ids = self.gate(x, self.num_shared)
                return fused_moe(x, self.experts.w13, self.experts.w2, weights, expert_ids, shared)

            return kernel_or_torch("moe_grouped_gemm", fused, lambda: self._apart(x))
        return self._apart(x)

    def _apart(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts (fused or the torch reference) and the shared MLP, each on its own."""
        weights, expert_ids = self.gate(x)
        return self.experts(x, weights, expert_ids) + self.shared_experts(x)
