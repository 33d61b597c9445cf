"""Streams one request's state chunks into a store with a single client-streaming Put.

Chunks are queued from the engine thread as each layer finishes and sent by gRPC's own thread,
so the engine never waits on the network; `finish` seals the key and waits for the store's ack.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

from splitserve.engine.state_codec import encode, seal
from splitserve.engine.state_transfer import LayerState
from splitserve.v1 import common_pb2, store_pb2, store_pb2_grpc

_END = None


class StateWriter:
    """Owns one Put stream: `write` from any thread, then `finish` (seal) or `cancel`."""

    def __init__(self, stub: store_pb2_grpc.StateStoreStub, key: str, owner: str, lease_s: float) -> None:
        self.key, self.owner, self.lease_s = key, owner, lease_s
        self.num_bytes = 0
        self.first_write_s: float | None = None  # monotonic time the first layer was queued
        self._queue: queue.Queue[common_pb2.StateChunk | None] = queue.Queue()
        self._stub = stub
        self._call = stub.Put.future(self._messages())

    def write(self, state: LayerState) -> None:
        if self.first_write_s is None:
            self.first_write_s = time.monotonic()
        for chunk in encode(state, self.key, self.owner, self.lease_s):
            self.num_bytes += len(chunk.data)
            self._queue.put(chunk)

    def finish(self, timeout_s: float) -> store_pb2.PutResponse:
        self._queue.put(seal(self.key, self.owner))
        self._queue.put(_END)
        return self._call.result(timeout=timeout_s)

    def stream_s(self) -> float:
        """Seconds from the first layer queued until now (call after `finish`); 0 if none was."""
        return 0.0 if self.first_write_s is None else time.monotonic() - self.first_write_s

    def cancel(self) -> None:
        self._queue.put(_END)
        self._call.cancel()

    def release(self) -> None:
        """Drop the stored state (after `finish`): the request ended and nobody will read it."""
        self._stub.Release(store_pb2.ReleaseRequest(key=self.key), timeout=10)

    def _messages(self) -> Iterator[common_pb2.StateChunk]:
        while (chunk := self._queue.get()) is not _END:
            yield chunk


class NoStateWriter:
    """Stands in for `StateWriter` when a request ends on its first token (max_tokens 1):
    nothing is exported, sent or sealed, and no store is touched."""

    key, owner, num_bytes = "", "", 0

    def finish(self, timeout_s: float) -> None:
        return None

    def stream_s(self) -> float:
        return 0.0

    def cancel(self) -> None:
        return None

    def release(self) -> None:
        return None
