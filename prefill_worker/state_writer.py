"""Streams one request's state into a store with a single Put, piece by piece as the prefill runs.

The store is this node's own (the gateway names the prefill's node store: one hop, the decode
reads it there), so pieces go through its shared-memory arena; a decode's own store on another
node (two hops, when the gateway knows no stores) gets bytes. The engine thread only queues each
piece it hands over (a copy of one prefill chunk's MLA rows of one layer, or a KDA state after
the last chunk); pieces under `HOLD_BYTES` in all wait and go together (one wakeup of the sending
thread, one message), and the put's call was opened when the previous put was acknowledged. Every
piece goes through `state_codec.write_state`: on the CPU its tensor is read in place; on a
device one copy into a pinned host buffer is queued on a side stream (the engine thread does not
wait for it). The sending thread (waiting for that copy first) copies the bytes once into the
store's arena, or cuts them into gRPC bytes for a store on another node, and checksums them, so
the engine never waits on the network, on a checksum or on a device sync. `finish` seals the key
and waits for the store's ack.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from splitserve.engine.host_staging import PinnedCopy
from splitserve.engine.state_codec import write_state
from splitserve.engine.state_transfer import LayerState
from splitserve.state import StateKind
from splitserve.state.client import StateStoreClient

# Pieces are held until this many bytes are (or the seal): a small state (the tiny model's 0.5 MB)
# goes in one message instead of one per piece; a large model's pieces (MiBs each) still stream
# layer by layer as the prefill runs.
HOLD_BYTES = 1 << 20


class StateWriter:
    """Owns one `PutStream`: `write` from the engine thread, then `finish` (seal) or `cancel`."""

    def __init__(
        self,
        client: StateStoreClient,
        key: str,
        owner: str,
        lease_s: float,
        expected_bytes: int | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        self.key, self.owner = key, owner
        self.num_bytes = 0
        self.first_write_s: float | None = None  # monotonic time the first piece was queued
        self._client = client
        self._sent_until: dict[int, int] = {}  # MLA layer -> rows [0, n) already queued
        self._held: list[torch.Tensor | PinnedCopy] = []  # what the put reads, until finish
        # with the state's size the store's arena holds it in one region of that size;
        # shared_memory False: another node's store (two hops), written over the network
        sharing = {} if shared_memory is None else {"shared_memory": shared_memory}
        self._put = client.open_put(
            key,
            owner=owner,
            lease_s=lease_s,
            expected_bytes=expected_bytes,
            hold_bytes=HOLD_BYTES,
            warm_next=True,  # a worker keeps its client per store: its next put starts ready
            **sharing,
        )

    def write(self, state: LayerState) -> None:
        """Queue one piece (engine thread). Rows already queued are dropped: a preempted prefill
        recomputes its prompt from the start, and the store takes each chunk once."""
        if state.kind is StateKind.MLA_KV:
            sent = self._sent_until.get(state.layer_id, 0)
            if state.token_end <= sent:
                return
            if state.token_start < sent:
                skip = sent - state.token_start
                state = dataclasses.replace(state, tensor=state.tensor[skip:], token_start=sent)
            self._sent_until[state.layer_id] = state.token_end
        if self.first_write_s is None:
            self.first_write_s = time.monotonic()
        self.num_bytes += state.num_bytes
        self._held.append(write_state(self._put, state))

    def finish(self, timeout_s: float) -> None:
        """Seals the key and waits for the store; raises the store's error (`StateStoreError`)."""
        try:
            self._put.finish(timeout_s)
        finally:
            self._held.clear()

    def stream_s(self) -> float:
        """Seconds from the first piece queued until now (call after `finish`); 0 if none was."""
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
