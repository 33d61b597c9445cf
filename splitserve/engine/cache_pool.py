"""The cache tensors of one engine and the allocators that hand out their blocks and slots.

`BlockAllocator` owns block ids (all MLA layers share one block table per request);
`SlotAllocator` owns KDA state slots and zeroes a slot on allocation, so a fresh request always
starts from the zero state. Neither knows about requests; the scheduler holds the ids.
"""

from __future__ import annotations

import torch

from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.model_config import KimiLinearModelConfig


class BlockAllocator:
    """Free list of KV block ids; `allocate` is all-or-nothing."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))


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
