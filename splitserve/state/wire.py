"""State chunks and store records <-> the messages of proto/splitserve/v1/{common,store}.proto.

The one place a `StateKind` meets its proto enum; the store's servicer and its client both use it.
"""

from __future__ import annotations

import time

from splitserve.state.chunk import Chunk, ChunkMeta, HeadRange, StateKind
from splitserve.state.errors import InvalidChunkError
from splitserve.state.records import KeyInfo, StoreStats, TierStats
from splitserve.v1 import common_pb2, store_pb2

KIND_TO_PROTO = {
    StateKind.MLA_KV: common_pb2.STATE_KIND_MLA_KV,
    StateKind.KDA_CONV: common_pb2.STATE_KIND_KDA_CONV,
    StateKind.KDA_RECURRENT: common_pb2.STATE_KIND_KDA_RECURRENT,
}
KIND_FROM_PROTO = {v: k for k, v in KIND_TO_PROTO.items()}
_COUNTERS = (
    "num_keys",
    "num_hits",
    "num_misses",
    "num_prefix_hits",
    "num_spills",
    "num_evictions",
    "num_expiries",
    "num_releases",
    "num_corruptions",
    "num_prefix_lookups",
    "num_prefix_hit_tokens",
    "num_prefix_evictions",
    "num_prefix_keys",
    "num_prefix_bytes",
)


def chunk_to_proto(
    chunk: Chunk | ChunkMeta,
    *,
    owner: str = "",
    lease_s: float = 0.0,
    final: bool = False,
    region: str = "",
    region_offset: int = 0,
) -> common_pb2.StateChunk:
    """A chunk as a message; a bare `ChunkMeta` gives a metadata-only message (empty data), which
    with `region` says where in the store's arena the bytes are."""
    meta, data = (chunk.meta, chunk.data) if isinstance(chunk, Chunk) else (chunk, b"")
    if isinstance(data, memoryview):
        data = data.tobytes()  # protobuf takes bytes
    return common_pb2.StateChunk(
        key=meta.key,
        layer=meta.layer,
        kind=KIND_TO_PROTO[meta.kind],
        dtype=meta.dtype,
        shape=meta.shape,
        token_start=meta.token_start,
        token_end=meta.token_end,
        checksum=meta.checksum,
        data=data,
        chunk_index=meta.chunk_index,
        num_chunks=meta.num_chunks,
        owner=owner,
        lease_s=lease_s,
        final=final,
        region=region,
        region_offset=region_offset,
        **_heads_to_proto(meta.heads),
    )


def _heads_to_proto(heads: HeadRange | None) -> dict[str, int]:
    return (
        {}
        if heads is None
        else {"head_start": heads.start, "head_end": heads.end, "num_heads": heads.num_heads}
    )


def meta_from_proto(msg: common_pb2.StateChunk) -> ChunkMeta:
    if msg.kind not in KIND_FROM_PROTO:
        raise InvalidChunkError(
            f"chunk of key {msg.key!r} layer {msg.layer} has no state kind (got {msg.kind})"
        )
    return ChunkMeta(
        msg.key,
        msg.layer,
        KIND_FROM_PROTO[msg.kind],
        msg.dtype,
        tuple(msg.shape),
        msg.token_start,
        msg.token_end,
        msg.checksum,
        msg.chunk_index,
        msg.num_chunks,
        HeadRange(msg.head_start, msg.head_end, msg.num_heads) if msg.num_heads else None,
    )


def chunk_from_proto(msg: common_pb2.StateChunk) -> Chunk:
    return Chunk(meta_from_proto(msg), msg.data)


def seal_message(key: str, owner: str) -> common_pb2.StateChunk:
    """The message that only seals `key` (no kind, no data, final)."""
    return common_pb2.StateChunk(key=key, owner=owner, final=True)


def is_seal(msg: common_pb2.StateChunk) -> bool:
    return msg.final and msg.kind == common_pb2.STATE_KIND_UNSPECIFIED and not msg.data


def key_info_to_proto(
    info: KeyInfo | None, num_units: int = 0, num_tokens: int = 0
) -> store_pb2.LookupResponse:
    if info is None:
        return store_pb2.LookupResponse(found=False)
    return store_pb2.LookupResponse(
        found=True,
        key=info.key,
        num_units=num_units,
        num_tokens=num_tokens,
        owner=info.owner,
        sealed=info.sealed,
        num_bytes=info.num_bytes,
        num_layers=info.num_layers,
        lease_expiry_unix_s=time.time() + info.lease_remaining_s,
        chunks=[chunk_to_proto(meta) for meta in info.chunks],
    )


def key_info_from_proto(msg: store_pb2.LookupResponse) -> KeyInfo | None:
    if not msg.found:
        return None
    chunks = tuple(meta_from_proto(c) for c in msg.chunks)
    return KeyInfo(
        msg.key, msg.owner, msg.sealed, msg.num_bytes, msg.lease_expiry_unix_s - time.time(), chunks
    )


def stats_to_proto(stats: StoreStats) -> store_pb2.StoreStats:
    tiers = [store_pb2.TierStats(**vars(t)) for t in stats.tiers]
    return store_pb2.StoreStats(tiers=tiers, **{name: getattr(stats, name) for name in _COUNTERS})


def stats_from_proto(msg: store_pb2.StoreStats) -> StoreStats:
    tiers = [
        TierStats(t.name, t.num_bytes, t.capacity_bytes, t.num_objects, t.num_pinned, t.num_keys)
        for t in msg.tiers
    ]
    return StoreStats(tiers=tiers, **{name: getattr(msg, name) for name in _COUNTERS})
