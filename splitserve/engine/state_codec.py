"""LayerState <-> state `Chunk`s: a tensor's raw bytes, cut by splitserve.state's one chunker.

Only tensors meet bytes here; checksums, kinds, dtypes and the wire live in `splitserve.state`.
A dtype travels as torch's name (`float32`), listed in `splitserve.state.DTYPE_ITEMSIZE`, and
comes back with `getattr(torch, name)`.

An MLA layer's rows may arrive in several pieces (one per prefill chunk), so its chunks are
numbered by token: chunk_index is the position of the chunk's first token and num_chunks the
prompt's length. Those ids are unique per (key, layer, kind) however the prompt was cut, and
sorting by them orders the rows. KDA states keep 0..n-1. A tensor-parallel rank's KDA state names
its heads (`LayerState.heads`, in every chunk): each rank's share is an object of its own.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from splitserve.engine.host_staging import PinnedCopy, to_pinned
from splitserve.engine.state_transfer import LayerState
from splitserve.state import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    ChunkMeta,
    CorruptStateError,
    HeadRange,
    StateKind,
    make_chunks,
)


class PieceSink(Protocol):
    """Where `write_state` queues a tensor's bytes: the store client's `PutStream` (a worker owns
    it; the engine never imports gRPC), or a test's fake. `ready`, when given, is called by the
    thread that reads `data`, before it does (a device copy into `data` may still be running).
    `heads`: a tensor-parallel rank's share of a KDA state's heads (None: all of them)."""

    def write_state(
        self,
        layer: int,
        kind: StateKind | str,
        data: memoryview,
        *,
        dtype: str,
        shape: Sequence[int],
        token_start: int,
        token_end: int,
        num_tokens: int | None = None,
        heads: HeadRange | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None: ...


def encode(state: LayerState, key: str, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
    """`state` as `key`'s chunks along its first axis (rows stay whole).

    Lazy: nothing is copied to the host, cut or checksummed until the first chunk is asked for,
    so a writer can hand the generator to a sending thread. The host tensor's memory is read in
    place; each chunk's bytes are its one copy.
    """
    data, dtype, shape = host_bytes(state.tensor.detach().cpu())
    layout = _layout(state, dtype, shape)
    chunks = make_chunks(key, state.layer_id, state.kind, data, **layout, max_chunk_bytes=max_chunk_bytes)
    if state.kind is not StateKind.MLA_KV:
        yield from chunks
        return
    for chunk in chunks:  # numbered by token (see the module docstring)
        meta = dataclasses.replace(
            chunk.meta, chunk_index=chunk.meta.token_start, num_chunks=state.prompt_len
        )
        yield Chunk(meta, chunk.data)


def write_state(put: PieceSink, state: LayerState) -> torch.Tensor | PinnedCopy:
    """Queue `state` on `put` wherever its tensor lives (`PutStream.write_state`: copied once into
    the store's arena on its node, else cut into gRPC bytes, on the put's sending thread). A CPU
    tensor is read in place (`write_host_state`); a device tensor goes through `write_device_state`.
    Returns what the put reads, to keep until `finish`. Never waits for the device."""
    if state.tensor.device.type == "cpu":
        return write_host_state(put, state)
    return write_device_state(put, state)


def write_host_state(put: PieceSink, state: LayerState) -> torch.Tensor:
    """Queue a CPU `state` on `put`; returns the contiguous tensor the put reads in place."""
    tensor = state.tensor.detach().contiguous()  # no copy for the fresh copies states already are
    _queue(put, state, tensor)
    return tensor


def write_device_state(put: PieceSink, state: LayerState) -> PinnedCopy:
    """Queue a device `state` on `put`: one copy into a pinned host buffer on the device's side
    stream (`host_staging.to_pinned`, behind the caller's stream, which is never synced), which
    the put's sending thread waits for (`ready`) before copying the buffer on. No pageable copy."""
    copy = to_pinned(state.tensor.detach())
    _queue(put, state, copy.tensor, ready=copy.wait)
    return copy


def _queue(
    put: PieceSink, state: LayerState, tensor: torch.Tensor, ready: Callable[[], None] | None = None
) -> None:
    data, dtype, shape = host_bytes(tensor)
    num_tokens = state.prompt_len if state.kind is StateKind.MLA_KV else None  # MLA: numbered by token
    layout = _layout(state, dtype, shape)
    put.write_state(state.layer_id, state.kind, data, **layout, num_tokens=num_tokens, ready=ready)


def _layout(state: LayerState, dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """What a chunk and a put piece both say of a state's bytes: dtype, shape, token range (and the
    heads of a tensor-parallel rank's share)."""
    layout = {"dtype": dtype, "shape": shape, "token_start": state.token_start, "token_end": state.token_end}
    return layout if state.heads is None else {**layout, "heads": state.heads}


def host_bytes(tensor: torch.Tensor) -> tuple[memoryview, str, tuple[int, ...]]:
    """A CPU tensor's bytes (in place when it is contiguous), its dtype name and its shape."""
    tensor = tensor.contiguous()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    data = tensor.reshape(-1).view(torch.uint8).numpy().data  # numpy has no bfloat16: go through bytes
    return data, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)


def decode_pieces(chunks: Iterable[Chunk], kda_in_place: bool = False) -> Iterator[LayerState]:
    """What a reader scatters as chunks land: each MLA chunk at once as its own piece (its token
    range; no reassembly), each KDA state once all its chunks are in. The MLA pieces' tensors read
    the chunks' bytes in place (read-only: copy them, do not write to them); KDA states are joined
    into a new tensor, or with `kda_in_place` a state of one chunk (the usual) reads it in place
    too (for a caller that only copies them out, as the decode's TransferSink does).

    Raises `CorruptStateError` if a KDA state's chunks do not add up or the stream ends mid-state.
    """
    pending: dict[tuple[int, StateKind, HeadRange | None], list[Chunk]] = {}
    for chunk in chunks:
        meta = chunk.meta
        if meta.kind is StateKind.MLA_KV:
            if meta.chunk_index != meta.token_start or meta.num_chunks < meta.token_end:
                raise CorruptStateError(
                    f"{meta.describe()} covers tokens [{meta.token_start}, {meta.token_end}): an MLA "
                    "chunk is numbered by its first token out of the prompt's length"
                )
            tensor = _view(chunk.data, meta.dtype, meta.shape)
            yield LayerState(meta.layer, meta.kind, tensor, meta.token_start, meta.token_end, meta.num_chunks)
            continue
        object_id = (meta.layer, meta.kind, meta.heads)  # a rank's heads are an object of their own
        parts = pending.setdefault(object_id, [])
        _check_continues(parts, meta)
        parts.append(chunk)
        if len(parts) == meta.num_chunks:
            del pending[object_id]
            in_place = kda_in_place and len(parts) == 1  # no copy: a reader only copies it out
            tensor = _view(chunk.data, meta.dtype, meta.shape) if in_place else _tensor(parts)
            yield LayerState(
                meta.layer, meta.kind, tensor, parts[0].meta.token_start, meta.token_end, heads=meta.heads
            )
    if pending:
        raise CorruptStateError(f"state stream ended with {len(pending)} incomplete KDA states")


def decode(chunks: Iterable[Chunk]) -> Iterator[LayerState]:
    """Reassembles whole layer states from chunks in order per (layer, kind), as a Get streams
    them; MLA rows are joined into one state once they reach the prompt's last token.

    Yields each state as its last chunk lands. Raises `CorruptStateError` if the chunks of one
    state do not add up (out of order, mixed dtypes or row shapes) or the stream ends mid-state.
    """
    pending: dict[tuple[int, StateKind, HeadRange | None], list[Chunk]] = {}
    for chunk in chunks:
        meta = chunk.meta
        object_id = (meta.layer, meta.kind, meta.heads)
        parts = pending.setdefault(object_id, [])
        _check_continues(parts, meta)
        parts.append(chunk)
        if (meta.token_end if meta.kind is StateKind.MLA_KV else len(parts)) == meta.num_chunks:
            del pending[object_id]
            first = parts[0].meta
            yield LayerState(
                meta.layer, meta.kind, _tensor(parts), first.token_start, meta.token_end, heads=meta.heads
            )
    if pending:
        raise CorruptStateError(f"state stream ended with {len(pending)} incomplete layer states")


def _check_continues(parts: list[Chunk], meta: ChunkMeta) -> None:
    first = parts[0].meta if parts else meta
    # MLA chunks are numbered by token (a whole state starts at token 0); KDA ones 0..n-1
    mla_next = parts[-1].meta.token_end if parts else 0
    expected = mla_next if meta.kind is StateKind.MLA_KV else len(parts)
    if meta.chunk_index != expected or (meta.dtype, meta.shape[1:], meta.num_chunks) != (
        first.dtype,
        first.shape[1:],
        first.num_chunks,
    ):
        raise CorruptStateError(
            f"{meta.describe()} ({meta.dtype} {meta.shape}) does not continue the {len(parts)} chunks "
            f"before it ({first.dtype} {first.shape}); the state was written wrongly"
        )


def _view(data: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """`data` as a tensor without a copy (read-only memory: torch warns it would be unsafe to write)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _tensor(parts: list[Chunk]) -> torch.Tensor:
    """The chunks' bytes copied once into one new tensor (of the dtype and shape they describe)."""
    first = parts[0].meta
    shape = (sum(p.meta.shape[0] for p in parts), *first.shape[1:]) if first.shape else ()
    out = torch.empty(sum(len(p.data) for p in parts), dtype=torch.uint8)
    flat = out.numpy()
    start = 0
    for part in parts:
        flat[start : start + len(part.data)] = np.frombuffer(part.data, dtype=np.uint8)
        start += len(part.data)
    return out.view(getattr(torch, first.dtype)).reshape(shape)
