"""The state vocabulary every part shares: chunks, their kinds and dtypes, checksums, errors, records.

Torch-free and grpc-free at this level, so the engine, the workers and the store all speak it.
A request's state travels as `Chunk`s (`make_chunks` is the one chunker); the store's gRPC
edge lives beside it: `wire` (chunk <-> proto), `status` (error <-> gRPC status), `client`
(`StateStoreClient`, with the streaming `PutStream` and `ChunkStream` of `streams`). The store
itself (tiers, leases, servicer, server, actor) is the `state_store` component.
"""

from splitserve.state.chunk import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    Chunk,
    ChunkId,
    ChunkMeta,
    HeadRange,
    StateKind,
    make_chunks,
)
from splitserve.state.dtypes import DTYPE_ITEMSIZE
from splitserve.state.errors import (
    CorruptStateError,
    InvalidChunkError,
    KeySealedError,
    LeaseExpiredError,
    OwnershipError,
    StateEvictedError,
    StateNotFoundError,
    StateReleasedError,
    StateStoreError,
    StateTimeoutError,
    StateUnavailableError,
    StoreFullError,
)
from splitserve.state.records import KeyInfo, ReleaseResult, StoreStats, TierStats

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPE_ITEMSIZE",
    "MAX_CHUNK_BYTES",
    "Chunk",
    "ChunkId",
    "ChunkMeta",
    "CorruptStateError",
    "HeadRange",
    "InvalidChunkError",
    "KeyInfo",
    "KeySealedError",
    "LeaseExpiredError",
    "OwnershipError",
    "ReleaseResult",
    "StateEvictedError",
    "StateKind",
    "StateNotFoundError",
    "StateReleasedError",
    "StateStoreError",
    "StateTimeoutError",
    "StateUnavailableError",
    "StoreFullError",
    "StoreStats",
    "TierStats",
    "make_chunks",
]
