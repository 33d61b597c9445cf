"""Compile the decode step's Triton kernels at load, not in the first steps or inside a graph capture.

`warm_up_decode_kernels(model, batch_sizes)` launches each kernel a decode step takes on the model's
device once per batch size, with one layer's own weights (so the kernels see the strides, dtypes and
alignments the step will) and zero activations in scratch tensors of the step's layouts; the caches
are not touched. Triton compiles one binary per set of meta-parameters and argument specialisations,
which is why each batch size (CUDA graph bucket) gets its own launch. Where the torch references run
(a CPU), it launches nothing. fla's KDA recurrence warms up on its own first call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from torch import nn

from splitserve.engine.model.kda import KimiDeltaAttention
from splitserve.engine.model.kimi_linear import KimiLinearForCausalLM
from splitserve.engine.model.mla import MultiHeadLatentAttention
from splitserve.engine.model.moe import SparseMoE
from splitserve.engine.ops.fused_moe import SharedExperts, moe_backend
from splitserve.engine.ops.paged_mla import mla_backend
from splitserve.engine.ops.triton_kernel import fused_backend


def warm_up_decode_kernels(model: KimiLinearForCausalLM, batch_sizes: Iterable[int]) -> list[str]:
    """Launch every Triton kernel of a decode step once per batch size; returns what it warmed, in order."""
    device = model.model.embed_tokens.weight.device
    kda, mla, moe = (
        _first(model, KimiDeltaAttention),
        _first(model, MultiHeadLatentAttention),
        _first(model, SparseMoE),
    )
    glue, attention, experts = fused_backend(device), mla_backend(device), moe_backend(device)
    warmed: list[str] = []
    for rows in batch_sizes:
        if glue == "triton":
            warmed += _glue(model, kda, moe, experts == "triton", rows)
        if mla is not None and attention == "triton":
            from splitserve.engine.ops import paged_mla_triton

            paged_mla_triton.warm_up(
                mla.kv_a_layernorm.weight, mla.num_heads, mla.nope_dim, mla.rope_dim, rows
            )
            warmed.append("paged_mla")
        if moe is not None and experts == "triton":
            from splitserve.engine.ops import fused_moe

            mlp = moe.shared_experts
            shared = None
            if moe.fuse_shared and mlp.gate_up is not None:
                shared = SharedExperts(mlp.gate_up, mlp.down_proj.weight, moe.num_shared)
            routed, top_k = moe.experts, moe.gate.spec.top_k
            fused_moe.warm_up(routed.w13, routed.w2, top_k, shared, rows, routed.expert_parallel)
            warmed.append("fused_moe")
    return warmed


def _glue(
    model: KimiLinearForCausalLM,
    kda: KimiDeltaAttention | None,
    moe: SparseMoE | None,
    fused_experts: bool,
    rows: int,
) -> list[str]:
    """The norms, KDA's decode gates and the router (the glue kernels of `fused_backend`)."""
    from splitserve.engine.ops import kda_gates_triton, norms_triton, router_triton

    norm = model.model.norm.weight
    norms_triton.warm_up(norm, kda.o_norm.weight if kda else None, kda.num_heads if kda else 0, rows)
    mla = _first(model, MultiHeadLatentAttention)
    if mla is not None and mla.q_lora_rank is not None:  # the query's low-rank norm has its own width
        norms_triton.warm_up(mla.q_a_layernorm.weight, None, 0, rows)
    warmed = ["norms"]
    if kda is not None:
        kda_gates_triton.warm_up(
            kda.in_proj, kda.conv_weight, kda.dt_bias, kda.decay_rate, kda.num_heads, rows
        )
        warmed.append("kda_decode_gates")
    if moe is not None:
        gate = moe.gate
        num_shared = moe.num_shared if fused_experts and moe.fuse_shared else 0
        router_triton.warm_up(
            gate.weight, gate.e_score_correction_bias, gate.spec, num_shared, norm.dtype, rows
        )
        warmed.append("moe_router")
    return warmed


M = TypeVar("M", bound=nn.Module)


def _first(model: KimiLinearForCausalLM, kind: type[M]) -> M | None:
    return next((m for m in model.modules() if isinstance(m, kind)), None)
