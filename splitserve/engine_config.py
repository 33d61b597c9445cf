"""Engine knobs, frozen and validated at construction. Torch-free, so the frontend and the
deploy controller can build and ship it; the engine derives everything else from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine instance serves and how much it may batch and cache.

    `kv_cache_memory_bytes` pays for `max_num_seqs` KDA state slots first and MLA KV blocks with
    the rest. `max_model_len` defaults to the checkpoint's context. `chunk_boundary`, when set,
    makes every prefill chunk end on each multiple of it (where state snapshots are taken).
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int = 256 * 2**20
    block_size: int = 16
    max_model_len: int | None = None
    chunk_boundary: int | None = None
    seed: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "block_size": self.block_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1 (got {value})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} (got {self.dtype!r})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2 (got {self.max_model_len})")
        if self.chunk_boundary is not None and self.chunk_boundary < 1:
            raise ValueError(f"chunk_boundary must be a positive token count (got {self.chunk_boundary})")

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
