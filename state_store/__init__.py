"""The per-node state store: leased, checksummed state chunks in host RAM spilling to disk.

Torch-free. The core (`StateStore`) is plain Python; `servicer`/`server`/`client` put it on
gRPC (proto/store.proto) and `actor` runs one per Ray node.
"""

from state_store.chunk import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    Chunk,
    ChunkId,
    ChunkMeta,
    StateKind,
    make_chunks,
)
from state_store.errors import (
    CorruptStateError,
    LeaseExpiredError,
    StateEvictedError,
    StateNotFoundError,
    StateReleasedError,
    StateStoreError,
    StateUnavailableError,
)
from state_store.info import KeyInfo, ReleaseResult, StoreConfig, StoreStats
from state_store.store import StateStore

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "Chunk",
    "ChunkId",
    "ChunkMeta",
    "CorruptStateError",
    "KeyInfo",
    "LeaseExpiredError",
    "ReleaseResult",
    "StateEvictedError",
    "StateKind",
    "StateNotFoundError",
    "StateReleasedError",
    "StateStore",
    "StateStoreError",
    "StateUnavailableError",
    "StoreConfig",
    "StoreStats",
    "make_chunks",
]
