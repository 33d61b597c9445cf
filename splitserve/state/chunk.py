"""The unit of stored state: a self-describing tensor slice (`Chunk`) and its metadata.

Torch-free: a chunk is bytes plus dtype name and shape. A state object is every chunk sharing
(key, layer, kind); chunk i holds rows of dim 0, and concatenating them in chunk order along dim 0
gives the tensor back. `make_chunks` does the split so no chunk exceeds the wire's limits; it is
the only chunker (the engine's state_codec hands it a tensor's bytes).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.state import checksum
from splitserve.state.dtypes import DTYPE_ITEMSIZE
from splitserve.state.errors import InvalidChunkError

DEFAULT_CHUNK_BYTES = 1 << 20  # what writers split at: well under gRPC's 4 MiB message limit
MAX_CHUNK_BYTES = 3 << 20  # what the store accepts: a 4 MiB message keeps 1 MiB for metadata


class StateKind(str, enum.Enum):
    """Which part of a layer's state a chunk holds (proto: splitserve.v1.StateKind)."""

    MLA_KV = "mla_kv"  # MLA latent KV + shared rope key; rows are tokens
    KDA_CONV = "kda_conv"  # KDA short-convolution window of one request's slot
    KDA_RECURRENT = "kda_recurrent"  # KDA recurrent state of one request's slot


class HeadRange(NamedTuple):
    """The KDA heads [start, end) of `num_heads` a state object holds: a tensor-parallel rank's
    share (engine/parallel/heads.py re-shards on read). An object without one holds every head;
    MLA rows never have one (the latent is every head's: each rank holds it whole)."""

    start: int
    end: int
    num_heads: int


class ChunkId(NamedTuple):
    """Where a chunk sits in the store: unique per stored chunk. Objects of one (key, layer, kind)
    written by ranks of different head ranges are apart (`head_start`; -1: every head)."""

    key: str
    layer: int
    kind: StateKind
    chunk_index: int
    head_start: int = -1


@dataclass(frozen=True)
class ChunkMeta:
    """Everything about a chunk but its bytes; validated at construction."""

    key: str
    layer: int
    kind: StateKind
    dtype: str
    shape: tuple[int, ...]
    token_start: int
    token_end: int
    checksum: int
    chunk_index: int = 0
    num_chunks: int = 1
    heads: HeadRange | None = None  # a rank's share of a KDA state's heads; None: every head

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StateKind(self.kind))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.heads is not None:
            object.__setattr__(self, "heads", HeadRange(*(int(h) for h in self.heads)))
        heads = self.heads or HeadRange(0, 1, 1)
        problems = [
            (bool(self.key), "key must be a non-empty string"),
            (self.layer >= 0, f"layer must be >= 0 (got {self.layer})"),
            (
                self.dtype in DTYPE_ITEMSIZE,
                f"dtype {self.dtype!r} unknown; use one of {sorted(DTYPE_ITEMSIZE)}",
            ),
            (all(d >= 0 for d in self.shape), f"shape {self.shape} has a negative dimension"),
            (
                0 <= self.token_start <= self.token_end,
                f"token range [{self.token_start}, {self.token_end}) is not a range",
            ),
            (
                0 <= self.chunk_index < self.num_chunks,
                f"chunk_index {self.chunk_index} is outside [0, num_chunks={self.num_chunks})",
            ),
            (
                0 <= heads.start < heads.end <= heads.num_heads,
                f"heads [{heads.start}, {heads.end}) of {heads.num_heads} are not a range of heads",
            ),
            (
                self.heads is None or self.kind is not StateKind.MLA_KV,
                "MLA rows hold every head's latent: they have no head range",
            ),
        ]
        for ok, message in problems:
            if not ok:
                raise InvalidChunkError(f"chunk of key {self.key!r} layer {self.layer}: {message}")

    @property
    def id(self) -> ChunkId:
        head_start = -1 if self.heads is None else self.heads.start
        return ChunkId(self.key, self.layer, self.kind, self.chunk_index, head_start)

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    def describe(self) -> str:
        heads = (
            "" if self.heads is None else f" heads {self.heads.start}-{self.heads.end}/{self.heads.num_heads}"
        )
        return f"key {self.key!r} layer {self.layer} {self.kind.value}{heads} chunk {self.chunk_index}/{self.num_chunks}"


@dataclass(frozen=True)
class Chunk:
    """A chunk's metadata and bytes; `len(data)` must equal what shape and dtype say."""

    meta: ChunkMeta
    data: bytes | memoryview  # a memoryview: a zero-copy view of a shared-memory region

    def __post_init__(self) -> None:
        if len(self.data) != self.meta.num_bytes:
            raise InvalidChunkError(
                f"{self.meta.describe()}: {len(self.data)} bytes, but shape {self.meta.shape} of "
                f"{self.meta.dtype} is {self.meta.num_bytes} bytes"
            )


class ChunkSpan(NamedTuple):
    """One chunk's place in a tensor's bytes: [byte_start, byte_end), its shape and tokens."""

    byte_start: int
    byte_end: int
    shape: tuple[int, ...]
    token_start: int
    token_end: int


def chunk_layout(
    kind: StateKind | str,
    num_bytes: int,
    *,
    dtype: str,
    shape: Sequence[int],
    token_start: int,
    token_end: int,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[ChunkSpan]:
    """How one tensor of `num_bytes` splits along dim 0 into chunks of at most `max_chunk_bytes`.

    MLA KV rows are tokens, so each MLA chunk gets the token range of its rows; every other kind
    is a state at one point, and all its chunks carry the whole range. Raises
    `InvalidChunkError` if the bytes, shape and tokens do not agree.
    """
    kind = StateKind(kind)
    shape = tuple(int(d) for d in shape)
    if dtype not in DTYPE_ITEMSIZE:
        raise InvalidChunkError(f"dtype {dtype!r} unknown; use one of {sorted(DTYPE_ITEMSIZE)}")
    num_rows = shape[0] if shape else 1
    row_bytes = math.prod(shape[1:]) * DTYPE_ITEMSIZE[dtype] if shape else DTYPE_ITEMSIZE[dtype]
    if num_bytes != num_rows * row_bytes:
        raise InvalidChunkError(f"{num_bytes} bytes do not hold shape {shape} of {dtype}")
    if kind is StateKind.MLA_KV and num_rows != token_end - token_start:
        raise InvalidChunkError(f"MLA KV has {num_rows} rows for tokens [{token_start}, {token_end})")
    if row_bytes > max_chunk_bytes:
        raise InvalidChunkError(
            f"one row of shape {shape} is {row_bytes} bytes, over max_chunk_bytes={max_chunk_bytes}; "
            "reshape so dim 0 is finer (e.g. [heads * head_k_dim, head_v_dim])"
        )
    rows_per_chunk = max(1, max_chunk_bytes // row_bytes) if row_bytes else max(1, num_rows)
    spans = []
    for row in range(0, num_rows, rows_per_chunk) if num_rows else [0]:
        end = min(row + rows_per_chunk, num_rows)
        tokens = (
            (token_start + row, token_start + end) if kind is StateKind.MLA_KV else (token_start, token_end)
        )
        chunk_shape = (end - row, *shape[1:]) if shape else shape
        spans.append(ChunkSpan(row * row_bytes, end * row_bytes, chunk_shape, *tokens))
    return spans


def number_by_token(meta: ChunkMeta, num_tokens: int) -> ChunkMeta:
    """`meta` renumbered for an MLA layer written in several pieces (one per prefill chunk):
    chunk_index is its first token and num_chunks the prompt's `num_tokens`, so ids stay unique
    per (key, layer, kind) however the prompt was cut, and sort in row order."""
    return dataclasses.replace(meta, chunk_index=meta.token_start, num_chunks=num_tokens)


def _numbered_by_token(meta: ChunkMeta) -> bool:
    return (
        meta.kind is StateKind.MLA_KV
        and meta.num_chunks > 1
        and meta.chunk_index == meta.token_start
        and meta.num_chunks >= meta.token_end
    )


def can_cut(meta: ChunkMeta) -> bool:
    """Whether a chunk may be cut into smaller ones and keep its object's numbering: it is the
    object's only chunk (cut: 0..n-1 of n), or MLA rows numbered by token (cut: by token)."""
    return meta.num_chunks == 1 or _numbered_by_token(meta)


def cut(
    meta: ChunkMeta, data: bytes | bytearray | memoryview, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[Chunk]:
    """A `can_cut` chunk (its bytes verified) as checksummed chunks of at most `max_chunk_bytes`."""
    if not can_cut(meta):
        raise InvalidChunkError(f"{meta.describe()} cannot be cut: it is one of several chunks")
    chunks = make_chunks(
        meta.key,
        meta.layer,
        meta.kind,
        data,
        dtype=meta.dtype,
        shape=meta.shape,
        token_start=meta.token_start,
        token_end=meta.token_end,
        max_chunk_bytes=max_chunk_bytes,
        heads=meta.heads,
    )
    if not _numbered_by_token(meta):
        return chunks
    return [Chunk(number_by_token(c.meta, meta.num_chunks), c.data) for c in chunks]


def make_chunks(
    key: str,
    layer: int,
    kind: StateKind | str,
    data: bytes | bytearray | memoryview,
    *,
    dtype: str,
    shape: Sequence[int],
    token_start: int,
    token_end: int,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    heads: HeadRange | None = None,
) -> list[Chunk]:
    """Splits one tensor's bytes along dim 0 (`chunk_layout`) into checksummed chunks (each
    naming `heads`, the rank's share of a KDA state's heads, when given).

    `data` may be any C-contiguous buffer (a memoryview of a tensor's memory too): each chunk's
    bytes are copied out of it once, and nothing else is.
    """
    kind = StateKind(kind)
    view = memoryview(data).cast("B")
    spans = chunk_layout(
        kind,
        view.nbytes,
        dtype=dtype,
        shape=shape,
        token_start=token_start,
        token_end=token_end,
        max_chunk_bytes=max_chunk_bytes,
    )
    chunks = []
    for index, span in enumerate(spans):
        piece = view[span.byte_start : span.byte_end]
        meta = ChunkMeta(
            key,
            layer,
            kind,
            dtype,
            span.shape,
            span.token_start,
            span.token_end,
            checksum.compute(piece),
            index,
            len(spans),
            heads,
        )
        chunks.append(Chunk(meta, piece.tobytes()))
    return chunks
