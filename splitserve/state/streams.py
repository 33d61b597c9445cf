"""Handles on the store's two streaming RPCs: a Put fed from a queue, and a cancellable Get.

Both use the store's shared-memory arena when the client shares its node (`LocalArena`): a
piece written with `PutStream.write_state` is copied once into a region the store allocated and
committed by reference (a device's piece: from the pinned buffer its one device-to-host copy
filled, waited for on the sending thread); a Get hands out zero-copy views of regions, each
verified first.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from splitserve.state import checksum
from splitserve.state.chunk import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    ChunkMeta,
    HeadRange,
    StateKind,
    cut,
    number_by_token,
)
from splitserve.state.errors import InvalidChunkError, StateTimeoutError
from splitserve.state.shm import LocalArena, SlabWriter
from splitserve.state.status import error_from_rpc
from splitserve.state.transport import RemoteRegions
from splitserve.state.wire import chunk_from_proto, chunk_to_proto, meta_from_proto, seal_message
from splitserve.v1 import common_pb2, store_pb2, store_pb2_grpc

# (key, layer, kind, num_bytes) -> the name of a fresh region of the store's arena
Allocator = Callable[[str, int, StateKind, int], str]


@dataclass(frozen=True)
class StatePiece:
    """One tensor's bytes and what they are, queued by `PutStream.write_state`."""

    layer: int
    kind: StateKind
    data: bytes | bytearray | memoryview
    dtype: str
    shape: tuple[int, ...]
    token_start: int
    token_end: int
    max_chunk_bytes: int
    num_tokens: int | None  # MLA pieces of a layer numbered by token (`number_by_token`)
    heads: HeadRange | None = None  # a tensor-parallel rank's share of a KDA state's heads
    ready: Callable[[], None] | None = None  # called on the sending thread before `data` is read

    def meta(self, key: str) -> ChunkMeta:
        """The piece as one chunk of `key` (checksum still 0). Raises `InvalidChunkError` if an MLA
        piece's rows are not its tokens."""
        if self.kind is StateKind.MLA_KV and self.shape[:1] != (self.token_end - self.token_start,):
            raise InvalidChunkError(
                f"MLA KV of shape {self.shape} does not have a row per token of [{self.token_start}, {self.token_end})"
            )
        meta = ChunkMeta(
            key,
            self.layer,
            self.kind,
            self.dtype,
            self.shape,
            self.token_start,
            self.token_end,
            0,
            heads=self.heads,
        )
        return meta if self.num_tokens is None else number_by_token(meta, self.num_tokens)


class _Pieces(list[StatePiece]):
    """Pieces queued together (`PutStream.hold_bytes`), told apart from a list of chunks."""


_END = None  # queued last: the sending thread stops reading the queue
BATCH_FLUSH_BYTES = 8 << 20  # a backlog of pieces is committed in messages of about this many bytes
BATCH_MAX_CHUNKS = 1024  # and at most this many commits (~100 bytes each) per message
_READY = common_pb2.StateChunk()  # from `_messages`: nothing more is queued yet, send what was made


class WarmCall:
    """A PutBatch call opened before its put (`StateStoreClient(spare_region=True)` opens the
    next one when a put finishes): starting a streaming call costs Python gRPC 0.7-0.9 ms, a
    seventh of a 16 MiB handoff. Its request iterator blocks gRPC's sending thread until a
    `PutStream` attaches its messages (`attach`, once); `close` ends a call never used."""

    def __init__(self, stub: store_pb2_grpc.StateStoreStub) -> None:
        self._source: Iterator[store_pb2.StateChunks] | None = None
        self._attached: queue.SimpleQueue[Iterator[store_pb2.StateChunks]] = queue.SimpleQueue()
        self.call = stub.PutBatch.future(self)

    @property
    def usable(self) -> bool:
        """False once the call ended (cancelled, the channel closed, the store went away)."""
        return not self.call.done()

    def attach(self, messages: Iterator[store_pb2.StateChunks]) -> grpc.Future:
        self._attached.put(messages)
        return self.call

    def close(self) -> None:
        self.call.cancel()
        self._attached.put(iter(()))

    def __iter__(self) -> WarmCall:
        return self

    def __next__(self) -> store_pb2.StateChunks:
        if self._source is None:
            self._source = self._attached.get()
        return next(self._source)


def _if_acked(call: grpc.Future, then: Callable[[], None]) -> None:
    """`then()` if `call` (a PutBatch, just ended) was acknowledged (not failed nor cancelled)."""
    if not call.cancelled() and call.exception() is None:
        then()


class PutStream:
    """One client-streaming Put of one key, open until `finish` (seal and wait) or `cancel`.

    `write` only queues and returns at once, from any thread; gRPC's own thread iterates what was
    queued and sends it, so work inside a lazy iterable (cutting and checksumming a tensor) runs
    there too, never on the writer's thread. Chunks must belong to `key`. After `finish` or
    `cancel`, writes are dropped. With an `arena` and its `allocate`, `write_state` pieces go
    through shared memory (one copy each, several pieces per region: `SlabWriter`, whose first
    region is `expected_bytes` if given) and are committed by reference, those ready together in
    one PutBatch message (`_batches`); without, they are cut into chunks and sent as bytes.
    `on_finish` runs after a successful `finish` (the client leases its next spare region there);
    `on_acked` on gRPC's channel thread once the store acknowledged the seal, alongside `finish`
    returning (the client opens the next put's call there, off its writer's thread); a
    `warm_call` (opened ahead, unused) carries the put instead of a new call.

    With `hold_bytes`, `write_state` pieces are held on the writer's side until that many bytes
    are held (or `finish`), then queued as one item: the sending thread wakes once and commits
    them in one message. Each queued piece costs a wakeup of the sending thread and a message
    (about 0.4 ms of CPU in Python gRPC on a loaded 2-core box), more than copying and
    checksumming a small piece; pieces of `hold_bytes` or more still go at once, so a large
    state streams piece by piece as before, and what waits for the seal is under `hold_bytes`.
    """

    def __init__(
        self,
        stub: store_pb2_grpc.StateStoreStub,
        key: str,
        owner: str,
        lease_s: float | None = None,
        *,
        arena: LocalArena | None = None,
        allocate: Allocator | None = None,
        expected_bytes: int | None = None,
        first_region: Callable[[], str] | None = None,
        on_finish: Callable[[], None] | None = None,
        warm_call: WarmCall | None = None,
        hold_bytes: int = 0,
        on_acked: Callable[[], None] | None = None,
    ) -> None:
        self.key, self.owner, self.lease_s = key, owner, lease_s or 0.0
        self.hold_bytes = hold_bytes
        self._held = _Pieces()  # written, not yet queued (`hold_bytes`)
        self._held_bytes = 0
        self._held_lock = threading.Lock()
        self.expected_bytes = expected_bytes
        self._first_region = first_region
        self._on_finish = on_finish
        self._slabs: SlabWriter | None = None
        self.arena = arena if allocate is not None else None
        self._allocate = allocate
        self._queue: queue.SimpleQueue[Iterable[Chunk] | _Pieces | None] = queue.SimpleQueue()
        self._seal = False
        self._error: BaseException | None = None
        self._closed = threading.Event()
        batches = self._batches()
        self._call = warm_call.attach(batches) if warm_call is not None else stub.PutBatch.future(batches)
        if on_acked is not None:
            self._call.add_done_callback(lambda call: _if_acked(call, on_acked))

    def write(self, chunks: Iterable[Chunk]) -> None:
        """Queues `chunks` (a list, or a generator to run on the sending thread)."""
        if not self._closed.is_set():
            self._queue.put(chunks)

    def write_state(
        self,
        layer: int,
        kind: StateKind | str,
        data: bytes | bytearray | memoryview,
        *,
        dtype: str,
        shape: Sequence[int],
        token_start: int,
        token_end: int,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_tokens: int | None = None,
        heads: HeadRange | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Queues one tensor's bytes (any C-contiguous buffer, e.g. a CPU tensor's memory) as
        `key`'s state of (layer, kind); returns at once. On the sending thread it is copied once
        into an arena region and committed in chunks of `max_chunk_bytes`, or cut into chunks and
        sent as bytes when the store is not on this node. `data` must not change until `finish`
        returns (nothing copies it before the sending thread does). `ready`, if given, is called
        on the sending thread before `data` is read: `data` may be a pinned buffer a device copy
        is still filling (`engine.host_staging.PinnedCopy.wait`). An MLA layer written in
        several pieces (one per prefill chunk) passes the prompt's `num_tokens`: its chunks are
        then numbered by token (`number_by_token`), as the engine's state codec numbers them.
        `heads`: the share of a KDA state's heads a tensor-parallel rank writes (`HeadRange`).
        Held instead of queued while fewer than `hold_bytes` are held (see the class)."""
        piece = StatePiece(
            layer,
            StateKind(kind),
            data,
            dtype,
            tuple(int(d) for d in shape),
            token_start,
            token_end,
            max_chunk_bytes,
            num_tokens,
            heads,
            ready,
        )
        with self._held_lock:
            if self._closed.is_set():
                return
            self._held.append(piece)
            self._held_bytes += memoryview(data).nbytes
            if self._held_bytes >= self.hold_bytes:
                self._queue_held()

    def _queue_held(self) -> None:
        """Hands the held pieces to the sending thread as one item: one wakeup, one message."""
        if self._held:
            self._queue.put(self._held)
            self._held, self._held_bytes = _Pieces(), 0

    def finish(self, timeout_s: float) -> tuple[int, int]:
        """Seals the key after everything written and waits for the store's ack; returns its
        (chunks, bytes) count. Raises the store's error, or `StateTimeoutError` after `timeout_s`."""
        self._seal = True
        self._close()
        try:
            reply = self._call.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            self._call.cancel()
            raise StateTimeoutError(
                f"the store did not acknowledge the put of key {self.key!r} within {timeout_s} s"
            ) from None
        except grpc.RpcError as e:
            if self._error is not None:  # the sending thread failed first: its error says why
                raise self._error from None
            raise error_from_rpc(e) from None
        if self._error is not None:
            raise self._error
        if self._on_finish is not None:  # after the ack: off the transfer's path
            self._on_finish()
        return reply.num_chunks, reply.num_bytes

    def cancel(self) -> None:
        """Abandons the put; what was stored stays until released or its lease runs out."""
        self._call.cancel()  # before the queue ends, so the store never sees a clean end
        self._close()

    def _close(self) -> None:
        """Ends the queue; when sealing, what is held goes first (cancelling drops it)."""
        with self._held_lock:
            if not self._closed.is_set():
                if self._seal:
                    self._queue_held()
                self._closed.set()
                self._queue.put(_END)

    def _batches(self) -> Iterator[store_pb2.StateChunks]:
        """`_messages` as PutBatch messages: the region commits (no bytes) and the seal that were
        ready together go in one, so a backlog of pieces costs one message, not one each, while
        a piece written alone still goes at once; a chunk carrying bytes goes alone."""
        batch: list[common_pb2.StateChunk] = []
        for msg in self._messages():
            if msg is not _READY and not msg.data:
                batch.append(msg)
                continue
            if batch:
                yield store_pb2.StateChunks(chunks=batch)
                batch = []
            if msg is not _READY:
                yield store_pb2.StateChunks(chunks=[msg])
        if batch:
            yield store_pb2.StateChunks(chunks=batch)

    def _messages(self) -> Iterator[common_pb2.StateChunk]:
        """Each queued item's messages, then the seal; `_READY` whenever the queue is empty or
        `BATCH_FLUSH_BYTES` (or `BATCH_MAX_CHUNKS` pieces) were placed since the last (all made
        so far should go out now, so
        a reader verifies and scatters them while later pieces are copied)."""
        placed_bytes = num_placed = 0
        try:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    yield _READY
                    placed_bytes = num_placed = 0
                    item = self._queue.get()
                if item is _END:
                    break
                if isinstance(item, _Pieces):
                    for piece in item:
                        yield from self._piece_messages(piece)
                        placed_bytes += memoryview(piece.data).nbytes
                        num_placed += 1
                        if placed_bytes >= BATCH_FLUSH_BYTES or num_placed >= BATCH_MAX_CHUNKS:
                            yield _READY
                            placed_bytes = num_placed = 0
                else:
                    for chunk in item:
                        yield chunk_to_proto(chunk, owner=self.owner, lease_s=self.lease_s)
        except Exception as e:  # noqa: BLE001 - ends the stream unsealed; finish raises it
            self._error = e
            return
        finally:
            if self._slabs is not None:
                self._slabs.close()
        if self._seal:
            yield seal_message(self.key, self.owner)

    def _piece_messages(self, piece: StatePiece) -> Iterator[common_pb2.StateChunk]:
        if piece.ready is not None:
            piece.ready()
        source = memoryview(piece.data).cast("B")
        whole = piece.meta(self.key)
        if whole.num_bytes != source.nbytes:
            raise InvalidChunkError(f"{source.nbytes} bytes do not hold shape {piece.shape} of {piece.dtype}")
        if self.arena is None or self._allocate is None:
            for chunk in cut(whole, source, piece.max_chunk_bytes):  # checksums its chunks
                yield chunk_to_proto(chunk, owner=self.owner, lease_s=self.lease_s)
            return
        if self._slabs is None:
            self._slabs = SlabWriter(
                self.arena, self._allocate_region, self.expected_bytes, self._first_region
            )
        region, offset, target = self._slabs.place(piece.layer, piece.kind.value, source)
        # the whole piece is one chunk: one message in, one view out
        meta = dataclasses.replace(whole, checksum=checksum.compute(target))
        target.release()
        yield chunk_to_proto(
            meta, owner=self.owner, lease_s=self.lease_s, region=region, region_offset=offset
        )

    def _allocate_region(self, layer: int, kind: str, num_bytes: int) -> str:
        assert self._allocate is not None
        return self._allocate(self.key, layer, StateKind(kind), num_bytes)


class ChunkStream:
    """One Get: iterate it once for the key's chunks as they land, each checksum verified here
    (a damaged one raises `CorruptStateError` and is never handed out). `cancel`, from any thread,
    ends the RPC and the iteration quietly; other failures raise the store's errors.

    `call` is a GetBatch (several chunks per message). With an `arena` (the Get asked for
    regions), a chunk in the store's arena comes as a
    read-only memoryview of its region: zero-copy, valid as long as it is referenced; or, read
    from another node through a transfer engine (`RemoteRegions`), as a buffer of its own."""

    def __init__(self, call: grpc.Call, arena: LocalArena | RemoteRegions | None = None) -> None:
        self._call = call
        self._arena = arena
        self.cancelled = False

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for chunk in self._chunks():
                checksum.verify(chunk.data, chunk.meta.checksum, f"{chunk.meta.describe()} as received")
                yield chunk
        except grpc.RpcError as e:
            if not self.cancelled:
                raise error_from_rpc(e) from None
        finally:
            self._call.cancel()  # no-op once finished; frees the server's thread if we stop early

    def cancel(self) -> None:
        self.cancelled = True
        self._call.cancel()

    def _chunks(self) -> Iterator[Chunk]:
        """Each message's chunks, unverified; the region references of one message are read
        together (one batch of a transfer engine)."""
        arena = self._arena
        for batch in self._call:  # type: ignore[attr-defined]
            in_regions = [msg for msg in batch.chunks if msg.region] if arena is not None else []
            metas = [meta_from_proto(msg) for msg in in_regions]
            places = [(msg.region, msg.region_offset, meta.num_bytes) for msg, meta in zip(in_regions, metas)]
            read = iter(
                zip(metas, arena.read_many(places) if arena is not None and places else [], strict=True)
            )
            for msg in batch.chunks:
                yield Chunk(*next(read)) if msg.region and arena is not None else chunk_from_proto(msg)
