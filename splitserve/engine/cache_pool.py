"""The cache tensors of one engine and the allocators that hand out their blocks and slots.

`BlockAllocator` owns block ids (all MLA layers share one block table per request), counting the
block tables that hold each; `SlotAllocator` owns KDA state slots and zeroes a slot on allocation,
so a fresh request always starts from the zero state. Neither knows about requests; the scheduler
holds the ids. `copy_kv_rows` and `copy_state_slot` copy between blocks and slots (copy on write).
"""

from __future__ import annotations

import torch

from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.model_config import KimiLinearModelConfig


class BlockAllocator:
    """Free list of KV block ids, each counted by the block tables holding it (`share` adds one:
    samples of one prompt share its blocks); a block is free again when none holds it.
    `allocate` is all-or-nothing."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        return self._take(count)

    def _take(self, count: int) -> list[int]:
        """`count` blocks off the free list, each held by one block table."""
        got = [self._free.pop() for _ in range(count)]
        for b in got:
            self._refs[b] = 1
        return got

    def share(self, block_ids: list[int] | tuple[int, ...]) -> None:
        """One more block table holds these (held) blocks."""
        for b in block_ids:
            self._refs[b] += 1

    def free(self, block_ids: list[int]) -> None:
        for b in reversed(block_ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]


class SlotAllocator:
    """Free list of KDA state slots; a slot handed out reads as the zero state in every layer."""

    def __init__(self, num_slots: int, caches: LayerCaches) -> None:
        self.num_slots = num_slots
        self._caches = caches
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        for t in (*self._caches.kda_conv.values(), *self._caches.kda_recurrent.values()):
            t[slot].zero_()
        if self._caches.replay is not None:
            self._caches.replay.reset(slot)  # no records of the slot's last request survive
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)


def copy_kv_rows(caches: LayerCaches, src_block: int, dst_block: int, num_rows: int, block_size: int) -> None:
    """Copy the first `num_rows` rows of block `src_block` into `dst_block`, in every MLA layer."""
    src, dst = src_block * block_size, dst_block * block_size
    for kv in caches.mla_kv.values():
        kv[dst : dst + num_rows].copy_(kv[src : src + num_rows])


def copy_state_slot(caches: LayerCaches, src_slot: int, dst_slot: int) -> None:
    """Copy every KDA layer's conv and recurrent state from `src_slot` into `dst_slot` (its
    ReplaySSM records folded into the state first, so the copy is exact)."""
    if caches.replay is not None:
        caches.replay.flush(src_slot)
        caches.replay.reset(dst_slot)
    for t in (*caches.kda_conv.values(), *caches.kda_recurrent.values()):
        t[dst_slot].copy_(t[src_slot])


def allocate_caches(
    plan: CachePlan, config: KimiLinearModelConfig, device: torch.device | str, scratch: bool = False
) -> LayerCaches:
    """One tensor per cache kind, viewed per layer, sized exactly by the plan.

    `scratch`: one more KV block (id `plan.num_blocks`) and state slot (id `plan.num_slots`) than the
    plan, which no allocator hands out: padding rows of a decode batch write there (cuda_graph_plan.py).
    """
    mla_ids, kda_ids = config.mla_layer_ids, config.kda_layer_ids
    extra = int(scratch)
    rows = (plan.num_blocks + extra) * plan.mla.block_size
    # the specs name their dtypes as torch does ("bfloat16" is torch.bfloat16)
    kv_dtype, conv_dtype = getattr(torch, plan.mla.dtype), getattr(torch, plan.kda.conv_dtype)
    kv = torch.zeros(len(mla_ids), rows, plan.mla.entry_dim, dtype=kv_dtype, device=device)
    num_slots = plan.num_slots + extra
    conv = torch.zeros(len(kda_ids), num_slots, *plan.kda.conv_shape, dtype=conv_dtype, device=device)
    rec = torch.zeros(len(kda_ids), num_slots, *plan.kda.recurrent_shape, dtype=torch.float32, device=device)
    return LayerCaches(
        mla_kv={lid: kv[i] for i, lid in enumerate(mla_ids)},
        kda_conv={lid: conv[i] for i, lid in enumerate(kda_ids)},
        kda_recurrent={lid: rec[i] for i, lid in enumerate(kda_ids)},
    )
