"""Streams one request's state into a store with a single Put, layer by layer as the prefill runs.

The engine thread only queues each finished layer; gRPC's sending thread cuts it into chunks,
checksums and sends them, so the engine never waits on the network or on crc32. `finish` seals
the key and waits for the store's ack.
"""

from __future__ import annotations

import time

from splitserve.engine.state_codec import encode
from splitserve.engine.state_transfer import LayerState
from splitserve.state.client import StateStoreClient


class StateWriter:
    """Owns one `PutStream`: `write` from the engine thread, then `finish` (seal) or `cancel`."""

    def __init__(self, client: StateStoreClient, key: str, owner: str, lease_s: float) -> None:
        self.key, self.owner = key, owner
        self.num_bytes = 0
        self.first_write_s: float | None = None  # monotonic time the first layer was queued
        self._client = client
        self._put = client.open_put(key, owner=owner, lease_s=lease_s)

    def write(self, state: LayerState) -> None:
        if self.first_write_s is None:
            self.first_write_s = time.monotonic()
        self.num_bytes += state.tensor.numel() * state.tensor.element_size()
        self._put.write(encode(state, self.key))  # a generator: runs on the sending thread

    def finish(self, timeout_s: float) -> None:
        """Seals the key and waits for the store; raises the store's error (`StateStoreError`)."""
        self._put.finish(timeout_s)

    def stream_s(self) -> float:
        """Seconds from the first layer queued until now (call after `finish`); 0 if none was."""
        return 0.0 if self.first_write_s is None else time.monotonic() - self.first_write_s

    def cancel(self) -> None:
        self._put.cancel()

    def release(self) -> None:
        """Drop the stored state (after `finish`): the request ended and nobody will read it."""
        self._client.release(self.key)


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
