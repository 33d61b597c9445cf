"""Multi-head Latent Attention (no RoPE in Kimi Linear; the "rope" key part is shared, unrotated).

The KV pool of a layer holds, per token, the normalised latent `c` (`kv_lora_rank`) and the
shared key part `k_r` (`qk_rope_head_dim`). Attention runs in the latent space (weight
absorption): `score = (W_uk^T q_nope) . c + q_r . k_r`, `out = W_uv (sum p c)`, one KV "head"
shared by all query heads, so the pool never holds per-head keys or values.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.forward_batch import ForwardBatch
from splitserve.engine.model.layers import RMSNorm
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.ops.paged_mla import mla_backend, paged_mla_torch, write_kv
from splitserve.engine.ops.triton_kernel import kernel_or_torch
from splitserve.engine.parallel.group import SINGLE, TensorParallel
from splitserve.engine.parallel.shard import set_shard


class MultiHeadLatentAttention(nn.Module):
    """One MLA layer; parameters named as in the checkpoint; absorbed weights built at load. Under
    tensor parallelism it holds its rank's heads and returns its partial sum of o_proj's output."""

    def __init__(self, config: KimiLinearModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        # tensor parallel: a rank keeps its heads' query and up-projections and o_proj rows; the
        # latent (kv_a_proj, its norm, the KV pool) is per token, shared by every head: replicated
        self.tp = tp
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        self.scale = qk_dim**-0.5
        bias = config.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        query = self.q_proj if self.q_lora_rank is None else self.q_b_proj
        set_shard(query.weight, tp.shard(0))
        set_shard(self.kv_b_proj.weight, tp.shard(0))
        set_shard(self.o_proj.weight, tp.shard(1))
        self.w_uk = torch.empty(0)  # [H, nope, rank]
        self.w_uv = torch.empty(0)  # [H, v, rank]

    def finalize(self) -> None:
        if self.tp.rank and self.o_proj.bias is not None:
            with torch.no_grad():
                self.o_proj.bias.zero_()  # the ranks' outputs are summed: rank 0 alone adds the bias
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        self.w_uk = w[:, : self.nope_dim].contiguous()
        self.w_uv = w[:, self.nope_dim :].contiguous()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_pool: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        norm = self.kv_a_layernorm
        write_kv(self.kv_a_proj_with_mqa(x), norm.weight, norm.eps, kv_pool, batch.slot_mapping)
        # absorb W_uk into the query: [T, H, nope] x [H, nope, rank] -> [T, H, rank]
        q_latent = torch.einsum("thn,hnr->thr", q[..., : self.nope_dim], self.w_uk)
        q_rope = q[..., self.nope_dim :]
        if mla_backend(kv_pool.device) == "triton":
            out = kernel_or_torch(
                "paged_mla",
                lambda: self._attend_triton(q_latent, q_rope, batch, kv_pool),
                lambda: self._attend_torch(q_latent, q_rope, batch, kv_pool),
            )
        else:
            out = self._attend_torch(q_latent, q_rope, batch, kv_pool)
        return self.o_proj(out)

    def _attend_torch(
        self, q_latent: torch.Tensor, q_rope: torch.Tensor, batch: ForwardBatch, kv_pool: torch.Tensor
    ) -> torch.Tensor:
        q_full = torch.cat([q_latent, q_rope], dim=-1)  # [T, H, rank + rope]
        out_latent = torch.empty(
            q_full.shape[0], self.num_heads, self.rank, dtype=q_full.dtype, device=q_full.device
        )
        for group in (batch.single, batch.multi):
            if group is not None:
                paged_mla_torch(q_full, kv_pool, group, self.rank, self.scale, out_latent)
        out = torch.einsum("thr,hvr->thv", out_latent, self.w_uv)
        return out.reshape(-1, self.num_heads * self.v_dim)

    def _attend_triton(
        self, q_latent: torch.Tensor, q_rope: torch.Tensor, batch: ForwardBatch, kv_pool: torch.Tensor
    ) -> torch.Tensor:
        """The kernels read the query's parts where they are and write the attention output head-major,
        which the absorbed W_uv reads as a batched matmul straight into o_proj's input layout: no copies."""
        from splitserve.engine.ops.paged_mla_triton import paged_mla_triton_split

        tokens, heads = q_latent.shape[0], self.num_heads
        dev, dtype = q_latent.device, q_latent.dtype
        out_latent = torch.empty(heads, tokens, self.rank, dtype=dtype, device=dev).transpose(0, 1)
        for group in (batch.single, batch.multi):
            if group is not None:
                paged_mla_triton_split(q_latent, q_rope, kv_pool, group, self.scale, out_latent)
        out = torch.empty(tokens, heads * self.v_dim, dtype=dtype, device=dev)
        # [H, T, rank] x [H, rank, v] -> [H, T, v], written as the [T, H * v] rows o_proj reads
        torch.bmm(
            out_latent.transpose(0, 1),
            self.w_uv.transpose(1, 2),
            out=out.view(tokens, heads, -1).transpose(0, 1),
        )
        return out
