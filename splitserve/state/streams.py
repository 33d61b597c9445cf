"""Handles on the store's two streaming RPCs: a Put fed from a queue, and a cancellable Get."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

import grpc

from splitserve.state import checksum
from splitserve.state.chunk import Chunk
from splitserve.state.errors import StateTimeoutError
from splitserve.state.status import error_from_rpc
from splitserve.state.wire import chunk_from_proto, chunk_to_proto, seal_message
from splitserve.v1 import common_pb2, store_pb2_grpc

_END = None  # queued last: the sending thread stops reading the queue


class PutStream:
    """One client-streaming Put of one key, open until `finish` (seal and wait) or `cancel`.

    `write` only queues and returns at once, from any thread; gRPC's own thread iterates what was
    queued and sends it, so work inside a lazy iterable (cutting and checksumming a tensor) runs
    there too, never on the writer's thread. Chunks must belong to `key`. After `finish` or
    `cancel`, writes are dropped.
    """

    def __init__(
        self, stub: store_pb2_grpc.StateStoreStub, key: str, owner: str, lease_s: float | None = None
    ) -> None:
        self.key, self.owner, self.lease_s = key, owner, lease_s or 0.0
        self._queue: queue.SimpleQueue[Iterable[Chunk] | None] = queue.SimpleQueue()
        self._seal = False
        self._closed = threading.Event()
        self._call = stub.Put.future(self._messages())

    def write(self, chunks: Iterable[Chunk]) -> None:
        """Queues `chunks` (a list, or a generator to run on the sending thread)."""
        if not self._closed.is_set():
            self._queue.put(chunks)

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
            raise error_from_rpc(e) from None
        return reply.num_chunks, reply.num_bytes

    def cancel(self) -> None:
        """Abandons the put; what was stored stays until released or its lease runs out."""
        self._call.cancel()  # before the queue ends, so the store never sees a clean end
        self._close()

    def _close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._queue.put(_END)

    def _messages(self) -> Iterator[common_pb2.StateChunk]:
        while (chunks := self._queue.get()) is not _END:
            for chunk in chunks:
                yield chunk_to_proto(chunk, owner=self.owner, lease_s=self.lease_s)
        if self._seal:
            yield seal_message(self.key, self.owner)


class ChunkStream:
    """One Get: iterate it once for the key's chunks as they land, each checksum verified here
    (a damaged one raises `CorruptStateError` and is never handed out). `cancel`, from any thread,
    ends the RPC and the iteration quietly; other failures raise the store's errors."""

    def __init__(self, call: grpc.Call) -> None:
        self._call = call
        self.cancelled = False

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for msg in self._call:  # type: ignore[attr-defined]
                chunk = chunk_from_proto(msg)
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
