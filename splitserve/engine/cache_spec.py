"""Cache specs: what one MLA block and one KDA state slot cost, and how a budget splits between them.

Memory planning follows from these types alone (after vLLM v1's kv_cache_interface): the
allocator never looks at the model, only at the specs and the budget. Torch-free, so the deploy
controller computes the context length the workers will serve (and tells the gateway) from the
cluster config and the checkpoint's config.json, with the same arithmetic the engine allocates by.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine_config import DTYPE_BYTES, EngineConfig

FP32_BYTES = 4  # the KDA recurrent state is kept in fp32 whatever the model dtype


@dataclass(frozen=True)
class MLAAttentionSpec:
    """Per MLA layer, per token: the normalised latent and the shared rope key, in `dtype`."""

    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.entry_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class KDAStateSpec:
    """Per KDA layer, per request slot: conv window (model dtype) and recurrent state (fp32)."""

    conv_dim: int
    conv_len: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: str

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_len)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_k_dim, self.head_v_dim)

    @property
    def slot_size_bytes(self) -> int:
        conv = self.conv_dim * self.conv_len * DTYPE_BYTES[self.conv_dtype]
        return conv + math.prod(self.recurrent_shape) * FP32_BYTES


@dataclass(frozen=True)
class CachePlan:
    """How many KV blocks and state slots one budget buys, for every layer of the model.

    `num_snapshots` KDA state snapshots (the prefix cache's, each the size of a slot) are paid
    from their own budget, `snapshot_memory_bytes`, beside the KV budget: 0 without caching.
    """

    mla: MLAAttentionSpec
    kda: KDAStateSpec
    num_mla_layers: int
    num_kda_layers: int
    num_blocks: int
    num_slots: int
    num_snapshots: int = 0
    replay_ring_bytes: int = 0  # per slot: its ReplaySSM rings in every KDA layer (0 without replay_window)

    @property
    def slot_room_bytes(self) -> int:
        """What each slot takes from the KV budget: its state and its ReplaySSM rings."""
        return self.slot_bytes + self.replay_ring_bytes

    @property
    def block_bytes(self) -> int:
        return self.mla.page_size_bytes * self.num_mla_layers

    @property
    def slot_bytes(self) -> int:
        return self.kda.slot_size_bytes * self.num_kda_layers

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        """The KV blocks and state slots (the KV budget's share; snapshots are `snapshot_bytes`)."""
        return self.num_blocks * self.block_bytes + self.num_slots * self.slot_room_bytes

    def snapshots_for(self, snapshot_memory_bytes: int) -> int:
        """How many snapshots `snapshot_memory_bytes` holds."""
        return snapshot_memory_bytes // self.slot_bytes if self.slot_bytes else 0

    @property
    def max_tokens_per_request(self) -> int:
        """The longest request the KV blocks hold when it has them all to itself."""
        return self.num_blocks * self.mla.block_size

    def bytes_for(self, num_slots: int, num_tokens_per_slot: int) -> int:
        """What `num_slots` slots and room for `num_tokens_per_slot` tokens in each of them cost."""
        blocks_per_slot = -(-num_tokens_per_slot // self.mla.block_size)
        return num_slots * (self.slot_room_bytes + blocks_per_slot * self.block_bytes)

    @classmethod
    def specs(
        cls,
        config: KimiLinearModelConfig,
        *,
        block_size: int,
        dtype: str,
        replay_window: int = 0,
        tensor_parallel: int = 1,
    ) -> CachePlan:
        """The per-block and per-slot costs alone (a plan of no blocks and no slots); a slot's
        ReplaySSM rings hold `replay_window` fp32 records (k, u, G) per KDA layer and head.

        Per rank under `tensor_parallel`: a rank's KDA slots hold its heads' states (1 / tensor_parallel
        of them); its MLA blocks hold every token's latent, which all heads share (replicated)."""
        mla = MLAAttentionSpec(block_size, config.kv_lora_rank, config.qk_rope_head_dim, dtype)
        num_heads = config.linear_num_heads // tensor_parallel
        kda = KDAStateSpec(
            conv_dim=3 * num_heads * config.linear_head_dim,
            conv_len=config.linear_conv_kernel_dim - 1,
            num_heads=num_heads,
            head_k_dim=config.linear_head_dim,
            head_v_dim=config.linear_head_dim,
            conv_dtype=dtype,
        )
        n_mla, n_kda = len(config.mla_layer_ids), len(config.kda_layer_ids)
        ring = replay_window * n_kda * kda.num_heads * (2 * kda.head_k_dim + kda.head_v_dim) * FP32_BYTES
        return cls(mla, kda, n_mla, n_kda, num_blocks=0, num_slots=0, replay_ring_bytes=ring)

    @classmethod
    def from_budget(
        cls,
        config: KimiLinearModelConfig,
        *,
        kv_cache_memory_bytes: int,
        block_size: int,
        num_slots: int,
        dtype: str,
        min_blocks: int,
        replay_window: int = 0,
        tensor_parallel: int = 1,
    ) -> CachePlan:
        """Give every slot its room first, then spend the rest on blocks; fail if too little is left."""
        unit = cls.specs(
            config,
            block_size=block_size,
            dtype=dtype,
            replay_window=replay_window,
            tensor_parallel=tensor_parallel,
        )
        slot_bytes = unit.slot_room_bytes
        left = kv_cache_memory_bytes - num_slots * slot_bytes
        num_blocks = left // unit.block_bytes if unit.block_bytes else max(min_blocks, 1)
        if num_blocks < min_blocks:
            need = num_slots * slot_bytes + min_blocks * unit.block_bytes
            raise ValueError(
                f"kv_cache_memory_bytes={kv_cache_memory_bytes:,} is too small: {num_slots} state slots "
                f"({slot_bytes:,} B each) and {min_blocks:,} KV blocks for one request of "
                f"{min_blocks * block_size:,} tokens ({unit.block_bytes:,} B each) need {need:,} B; "
                f"raise the budget or lower max_num_seqs / max_model_len"
            )
        return cls(
            unit.mla,
            unit.kda,
            unit.num_mla_layers,
            unit.num_kda_layers,
            int(num_blocks),
            num_slots,
            replay_ring_bytes=unit.replay_ring_bytes,
        )


def context_len(model: KimiLinearModelConfig, config: EngineConfig) -> int:
    """The length requests may reach if the budget allows: `max_model_len`, else the checkpoint's."""
    context = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > context:
        raise ValueError(f"max_model_len={config.max_model_len:,} exceeds the model's context ({context:,})")
    return config.max_model_len or context


def plan_cache(
    model: KimiLinearModelConfig, config: EngineConfig, kv_cache_memory_bytes: int
) -> tuple[CachePlan, int]:
    """The cache plan one engine (each of its ranks) allocates and the `max_model_len` it serves.

    An explicit `config.max_model_len` must fit the checkpoint's context and, for one request,
    the budget (else ValueError). Without one, the engine serves the longest request the budget
    holds with every slot paid for, at most the checkpoint's context (as vLLM estimates its
    maximum model length from the KV cache it could allocate).
    """
    limit = context_len(model, config)
    explicit = config.max_model_len is not None
    # at least 2 tokens (a prompt token and a generated one) when the length is ours to choose
    min_tokens = limit if explicit else 2
    plan = CachePlan.from_budget(
        model,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        block_size=config.block_size,
        num_slots=config.max_num_seqs,
        dtype=config.dtype,
        min_blocks=-(-min_tokens // config.block_size),
        replay_window=config.replay_window,
        tensor_parallel=config.tensor_parallel_size,
    )
    if config.enable_prefix_caching:
        plan = dataclasses.replace(plan, num_snapshots=plan.snapshots_for(config.snapshot_memory_bytes))
    return plan, limit if explicit else min(limit, plan.max_tokens_per_request)
