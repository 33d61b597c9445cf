"""Pulls one reserved request's state from the store while the prefill is still writing it.

Started when the decode worker accepts a reservation: one Get on the store the prefill writes
into (the prefill's own node's store: one hop; the arena when it shares this node, else streamed
bytes) waits for the key's first put and streams each chunk as it lands (checksums verified),
and this reader's own thread scatters every
piece straight into the reserved room through the engine's `ShardingSink` (each MLA chunk as
it lands, each KDA state once whole). The engine thread takes no part until admission, so a busy
decode worker adds no step per layer to a handoff. `wait` returns once the whole prompt's state
is in, or raises the reason it never will be.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from splitserve.engine.parallel.handoff import ShardingSink
from splitserve.engine.state_codec import decode_pieces
from splitserve.engine.state_transfer import LayerState
from splitserve.state import Chunk
from splitserve.state.client import StateStoreClient
from splitserve.state.transport import TransportClient


class StateReader:
    """Owns one Get stream and its thread; its sink counts what landed (tokens per MLA layer,
    KDA states), so MLA rows may arrive in any number of token ranges. `store` is the store read
    (the one whose key `release` frees), which need not be this node's."""

    def __init__(
        self,
        sink: ShardingSink,
        store: StateStoreClient,
        request_id: str,
        key: str,
        timeout_s: float,
        on_failure: Callable[[StateReader], None] | None = None,
        shared_memory: bool | None = None,
        transport: TransportClient | None = None,
        keep_copies: bool = False,
    ) -> None:
        self.sink, self.request_id, self.key, self.store = sink, request_id, key, store
        # keep_copies: a host copy of every piece read, for a copy of the state in this node's
        # store (it came from another node's, which releases it once read: ReplaySSM failover)
        self.copies: list[LayerState] | None = [] if keep_copies else None
        self.num_pieces = 0
        self.num_bytes = 0
        self.error: BaseException | None = None
        self.first_chunk_at: float | None = None
        self.done_at: float | None = None
        self._done = threading.Event()
        self._on_failure = on_failure
        # The store holds the Get open until the prefill's first put creates the key.
        # shared_memory False: another node's store, whose bytes cross the network even where
        # its arena happens to be mappable (two raylets on one machine).
        # With a transfer engine's `transport` another node's arena regions are pulled through it.
        sharing: dict[str, object] = {} if shared_memory is None else {"shared_memory": shared_memory}
        if transport is not None:
            sharing["transport"] = transport
        self._stream = store.get(key, timeout_s=timeout_s, wait_for_key=True, **sharing)  # type: ignore[arg-type]
        threading.Thread(target=self._pull, name=f"state-reader-{request_id}", daemon=True).start()

    def wait(self, timeout_s: float) -> None:
        """Returns once every piece is in; raises the store's error (`StateStoreError`, e.g.
        `CorruptStateError`), `TimeoutError`, or `RuntimeError` (cancelled, or the state fell short)."""
        if not self._done.wait(timeout_s):
            self.cancel()
            raise TimeoutError(f"state of {self.request_id} did not arrive within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error

    @property
    def failed(self) -> bool:
        """Whether the read ended without the whole state (its `on_failure` has run or runs now)."""
        return self._done.is_set() and self.error is not None

    def cancel(self) -> None:
        """Ends the Get from any thread; `wait` then raises."""
        self._stream.cancel()

    def release(self) -> None:
        """Frees the key in the store it was read from (raises `StateStoreError`)."""
        self.store.release(self.key)

    def _pull(self) -> None:
        rid = self.request_id
        try:
            # KDA states of one chunk are not copied here: the sink (and keep_copies) copies them
            for piece in decode_pieces(self._count(self._stream), kda_in_place=True):
                if self.copies is not None:  # before the sink: it may take the tensor as it is
                    self.copies.append(dataclasses.replace(piece, tensor=piece.tensor.clone()))
                self.sink.write(piece)  # into the reserved rows/slot, on this thread
                self.num_pieces += 1
            if not self.sink.complete:
                raise RuntimeError(f"state of {rid} ended short: {self.sink.missing()}")
        except BaseException as exc:
            self.error = RuntimeError(f"state transfer of {rid} cancelled") if self._stream.cancelled else exc
        finally:
            self.done_at = time.time()
            self._done.set()
            if self.error is not None and self._on_failure is not None:
                self._on_failure(self)

    def _count(self, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        for chunk in chunks:
            if self.first_chunk_at is None:
                self.first_chunk_at = time.time()
            self.num_bytes += len(chunk.data)
            yield chunk
