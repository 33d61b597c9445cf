"""Engine knobs, frozen and validated at construction. Torch-free, so the frontend and the
deploy controller can build and ship it; the engine derives everything else from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from splitserve.state.dtypes import DTYPE_ITEMSIZE

# The dtypes a model may run in (torch's names), with their bytes per element from the one table.
DTYPE_BYTES = {name: DTYPE_ITEMSIZE[name] for name in ("float32", "bfloat16", "float16")}
DTYPES = tuple(DTYPE_BYTES)
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine instance serves and how much it may batch and cache.

    `kv_cache_memory_bytes` pays for `max_num_seqs` KDA state slots first and MLA KV blocks with
    the rest; None sizes it from what is needed (see `splitserve.engine.cache_budget`).
    `max_model_len` None means the longest request the budget holds, at most the checkpoint's
    context; an explicit value must fit both or the engine refuses to start.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    # hybrid prefix caching (splitserve.config.CacheConfig says what each knob does); off by default
    # for an engine built directly, on by default in a cluster config
    enable_prefix_caching: bool = False
    prefix_unit: int = 64
    retention_interval: int = 0
    selective_retention: bool = True
    snapshot_memory_bytes: int = 64 * 2**20
    # the salt of the prefix names the engine makes itself (splitserve.prefix_hash): "" offline; a
    # cluster may pass its served model name, the salt of the chains its gateway sends
    prefix_salt: str = ""
    # ReplaySSM (engine/replay_ring.py): KDA decode reads a checkpoint + a ring of this many step
    # records and publishes them every window; 0: the plain recurrent path
    replay_window: int = 0
    # how a decoding request that loses its KV room is preempted (engine/swap_space.py): "recompute"
    # frees its state and computes prompt + outputs again; "swap" copies its state to a swap space
    # (host memory of at most `swap_space_bytes`, or its node's store in a cluster) and back
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 4 * 2**30
    # CUDA graphs for decode steps (engine/cuda_graph.py): one graph per batch-size bucket, captured
    # at start on a CUDA device; () picks 1, 2, 4, 8, 16, 24, ... up to max_num_seqs. A decode batch
    # of b rows replays the smallest bucket >= b, padded with rows that touch only a scratch KV row
    # and state slot. enforce_eager: never capture (every step runs eagerly, unpadded).
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    # pad single-token rows to the bucket even when the step runs eagerly (the CPU tests of the
    # padding path; costs compute): graphs always pad, this only forces it without them
    pad_decode_batches: bool = False
    # tensor parallelism (engine/parallel/): ranks as processes, rank 0 this one (vLLM's keyword); heads,
    # MLP columns and the vocabulary split over them. expert_parallel: the routed experts spread over
    # the ranks whole instead of each being cut
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    # async scheduling (engine/step_pipeline.py): queue step N+1 before reading step N's sampled ids,
    # so the host's scheduling and token handling overlap the device's work. None: on for a CUDA
    # device, off elsewhere (on a CPU the forward runs on the host thread: nothing to overlap)
    # (a tensor-parallel engine runs synchronously: its ranks follow one step at a time)
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "prefix_unit": self.prefix_unit,
        }
        if self.kv_cache_memory_bytes is not None:
            positive["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1 (got {value})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} (got {self.dtype!r})")
        if self.prefix_unit % self.block_size:
            raise ValueError(
                f"prefix_unit must be a multiple of block_size ({self.block_size}; got {self.prefix_unit})"
            )
        if self.retention_interval < 0 or self.retention_interval % self.prefix_unit:
            raise ValueError(
                f"retention_interval must be 0 or a multiple of prefix_unit ({self.prefix_unit}; "
                f"got {self.retention_interval})"
            )
        if self.replay_window < 0:
            raise ValueError(f"replay_window must be 0 (off) or a number of steps (got {self.replay_window})")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES} (got {self.preemption_mode!r})"
            )
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be at least 0 (got {self.swap_space_bytes})")
        if self.snapshot_memory_bytes < 0:
            raise ValueError(f"snapshot_memory_bytes must be at least 0 (got {self.snapshot_memory_bytes})")
        sizes = tuple(sorted({int(b) for b in self.cuda_graph_batch_sizes}))
        if sizes and sizes[0] < 1:
            raise ValueError(f"cuda_graph_batch_sizes must all be at least 1 (got {list(sizes)})")
        object.__setattr__(self, "cuda_graph_batch_sizes", sizes)  # frozen: normalised once, here
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1 (got {self.tensor_parallel_size})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2 (got {self.max_model_len})")

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
