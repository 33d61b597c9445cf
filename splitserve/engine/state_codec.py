"""LayerState <-> `StateChunk` messages: raw little-endian bytes in chunks under gRPC's limit,
each with a zlib.crc32 checksum (the store verifies it on put and on every read)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from splitserve.engine.state_transfer import KDA_CONV, KDA_RECURRENT, MLA_KV, LayerState
from splitserve.v1 import common_pb2

CHUNK_BYTES = 1 << 20  # 1 MiB: far under gRPC's 4 MiB default message limit

KIND_TO_PROTO = {
    MLA_KV: common_pb2.STATE_KIND_MLA_KV,
    KDA_CONV: common_pb2.STATE_KIND_KDA_CONV,
    KDA_RECURRENT: common_pb2.STATE_KIND_KDA_RECURRENT,
}
KIND_FROM_PROTO = {v: k for k, v in KIND_TO_PROTO.items()}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CorruptStateError(RuntimeError):
    """A state chunk's bytes do not match its checksum or its declared shape."""


def encode(state: LayerState, key: str, owner: str, lease_s: float = 0.0) -> Iterator[common_pb2.StateChunk]:
    """Split one layer state into chunks along its first axis (rows stay whole)."""
    tensor = state.tensor.detach().contiguous().cpu()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    row_bytes = max(1, tensor[0].numel() * tensor.element_size()) if tensor.shape[0] else 1
    rows_per_chunk = max(1, CHUNK_BYTES // row_bytes)
    pieces = list(torch.split(tensor, rows_per_chunk)) or [tensor]
    for index, piece in enumerate(pieces):
        data = piece.view(torch.uint8).numpy().tobytes() if piece.numel() else b""
        yield common_pb2.StateChunk(
            key=key,
            layer=state.layer_id,
            kind=KIND_TO_PROTO[state.kind],
            dtype=dtype,
            shape=list(piece.shape),
            token_start=state.token_start,
            token_end=state.token_end,
            checksum=zlib.crc32(data),
            data=data,
            chunk_index=index,
            num_chunks=len(pieces),
            owner=owner,
            lease_s=lease_s,
        )


def seal(key: str, owner: str) -> common_pb2.StateChunk:
    """The last message of a put stream: nothing more will be written under `key`."""
    return common_pb2.StateChunk(key=key, owner=owner, final=True)


def decode(chunks: Iterable[common_pb2.StateChunk]) -> Iterator[LayerState]:
    """Reassemble layer states from chunks (in order per object); verify every checksum."""
    pending: dict[tuple[int, int], list[torch.Tensor]] = {}
    for chunk in chunks:
        if chunk.final and chunk.kind == common_pb2.STATE_KIND_UNSPECIFIED:
            continue  # a seal: the writer is done with the key
        if zlib.crc32(chunk.data) != chunk.checksum:
            raise CorruptStateError(
                f"state chunk {chunk.key} layer {chunk.layer} #{chunk.chunk_index} failed its checksum"
            )
        dtype = _DTYPES.get(chunk.dtype)
        if dtype is None or chunk.kind not in KIND_FROM_PROTO:
            raise CorruptStateError(
                f"state chunk with dtype {chunk.dtype!r} kind {chunk.kind} is not understood"
            )
        raw = torch.from_numpy(np.frombuffer(bytearray(chunk.data), dtype=np.uint8))
        piece = raw.view(dtype)
        if piece.numel() != int(np.prod(chunk.shape)):
            raise CorruptStateError(
                f"state chunk {chunk.key} layer {chunk.layer}: bytes do not fill its shape"
            )
        object_id = (chunk.layer, chunk.kind)
        parts = pending.setdefault(object_id, [])
        if chunk.chunk_index != len(parts):
            raise CorruptStateError(f"state chunk {chunk.key} layer {chunk.layer}: chunk out of order")
        parts.append(piece.reshape(tuple(chunk.shape)))
        if len(parts) == chunk.num_chunks:
            del pending[object_id]
            tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
            yield LayerState(
                chunk.layer, KIND_FROM_PROTO[chunk.kind], tensor, chunk.token_start, chunk.token_end
            )
    if pending:
        raise CorruptStateError(f"state stream ended with {len(pending)} incomplete objects")
