"""The KV cache budget of an engine started without `kv_cache_memory_bytes`.

The default is what the engine needs and no more: `max_num_seqs` state slots, each with KV room
for a request of the full context (`max_model_len`, else the checkpoint's), so nothing is ever
preempted for lack of blocks. That is capped by the device:

* CPU: at most `CPU_KV_CACHE_MAX_BYTES` (256 MiB). The cache is zero-filled at start, and a
  multi-GiB fill costs tens of seconds and as much resident memory for nothing on the small
  models a CPU serves; the cap keeps start-up to a second or two.
* CUDA: at most the memory left after the weights, keeping `1 - GPU_MEMORY_UTILIZATION` of the
  device's total free for activations (vLLM's `gpu_memory_utilization`, without its profiling),
  less the prefix cache's snapshot pool (`snapshot_memory_bytes`) when caching is on.

A checkpoint with a context longer than the capped budget holds then gets a shorter
`max_model_len` (see `cache_spec.plan_cache`); pass `kv_cache_memory_bytes` for more.
"""

from __future__ import annotations

import torch

from splitserve.engine.cache_spec import CachePlan, context_len
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine_config import EngineConfig

CPU_KV_CACHE_MAX_BYTES = 256 * 2**20
GPU_MEMORY_UTILIZATION = 0.9


def default_kv_cache_bytes(
    model: KimiLinearModelConfig, config: EngineConfig, device: torch.device
) -> tuple[int, str]:
    """The budget for `config` on `device` (call it after the weights are loaded), and why."""
    unit = CachePlan.specs(
        model,
        block_size=config.block_size,
        dtype=config.dtype,
        replay_window=config.replay_window,
        tensor_parallel=config.tensor_parallel_size,
    )
    num_tokens = context_len(model, config)
    need = unit.bytes_for(config.max_num_seqs, num_tokens)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks cached while loading are free for the KV cache too
        free, total = torch.cuda.mem_get_info(device)
        cap = int(GPU_MEMORY_UTILIZATION * total) - (total - free)  # the engine's share less what is in use
        if config.enable_prefix_caching:
            cap -= config.snapshot_memory_bytes  # the snapshot pool is allocated beside the KV cache
        where = (
            f"capped at the GPU memory left after the weights less {1 - GPU_MEMORY_UTILIZATION:.0%} of "
            f"the device ({cap / 2**20:,.0f} MiB)"
        )
        if cap <= 0:
            raise ValueError(
                f"no GPU memory is left for the KV cache: {free / 2**20:,.0f} MiB of "
                f"{total / 2**20:,.0f} MiB is free after loading the weights; free GPU memory or pass "
                "kv_cache_memory_bytes"
            )
    else:
        cap = CPU_KV_CACHE_MAX_BYTES
        where = f"capped at {CPU_KV_CACHE_MAX_BYTES // 2**20} MiB on CPU"
    why = (
        f"kv_cache_memory_bytes not given, so the default: what {config.max_num_seqs} requests of "
        f"{num_tokens:,} tokens need, {where}"
    )
    return min(need, cap), why
