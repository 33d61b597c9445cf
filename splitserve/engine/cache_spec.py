"""Cache specs: what one MLA block and one KDA state slot cost, and how a budget splits between them.

Memory planning follows from these types alone (after vLLM v1's kv_cache_interface): the
allocator never looks at the model, only at the specs and the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitserve.engine.model_config import KimiLinearModelConfig


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class MLAAttentionSpec:
    """Per MLA layer, per token: the normalised latent and the shared rope key, in `dtype`."""

    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.entry_dim * _dtype_bytes(self.dtype)


@dataclass(frozen=True)
class KDAStateSpec:
    """Per KDA layer, per request slot: conv window (model dtype) and recurrent state (fp32)."""

    conv_dim: int
    conv_len: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: torch.dtype

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_len)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_k_dim, self.head_v_dim)

    @property
    def slot_size_bytes(self) -> int:
        conv = self.conv_dim * self.conv_len * _dtype_bytes(self.conv_dtype)
        return conv + math.prod(self.recurrent_shape) * 4


@dataclass(frozen=True)
class CachePlan:
    """How many KV blocks and state slots one budget buys, for every layer of the model."""

    mla: MLAAttentionSpec
    kda: KDAStateSpec
    num_mla_layers: int
    num_kda_layers: int
    num_blocks: int
    num_slots: int

    @property
    def block_bytes(self) -> int:
        return self.mla.page_size_bytes * self.num_mla_layers

    @property
    def slot_bytes(self) -> int:
        return self.kda.slot_size_bytes * self.num_kda_layers

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes + self.num_slots * self.slot_bytes

    @classmethod
    def from_budget(
        cls,
        config: KimiLinearModelConfig,
        *,
        kv_cache_memory_bytes: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        min_blocks: int,
    ) -> CachePlan:
        """Give every slot its room first, then spend the rest on blocks; fail if too little is left."""
        mla = MLAAttentionSpec(block_size, config.kv_lora_rank, config.qk_rope_head_dim, dtype)
        kda = KDAStateSpec(
            conv_dim=3 * config.kda_qkv_dim,
            conv_len=config.linear_conv_kernel_dim - 1,
            num_heads=config.linear_num_heads,
            head_k_dim=config.linear_head_dim,
            head_v_dim=config.linear_head_dim,
            conv_dtype=dtype,
        )
        n_mla, n_kda = len(config.mla_layer_ids), len(config.kda_layer_ids)
        plan = cls(mla, kda, n_mla, n_kda, num_blocks=0, num_slots=num_slots)
        left = kv_cache_memory_bytes - num_slots * plan.slot_bytes
        num_blocks = left // plan.block_bytes if plan.block_bytes else max(min_blocks, 1)
        if num_blocks < min_blocks:
            need = num_slots * plan.slot_bytes + min_blocks * plan.block_bytes
            raise ValueError(
                f"kv_cache_memory_bytes={kv_cache_memory_bytes:,} is too small: {num_slots} state slots "
                f"({plan.slot_bytes:,} B each) and {min_blocks} KV blocks for one max_model_len request "
                f"({plan.block_bytes:,} B each) need {need:,} B; raise the budget or lower "
                f"max_num_seqs / max_model_len"
            )
        return cls(mla, kda, n_mla, n_kda, num_blocks=int(num_blocks), num_slots=num_slots)
