"""Pulls one reserved request's state from the store while the prefill is still writing it.

Started when the decode worker accepts a reservation: one Get waits for the key's first put and
streams each chunk as it lands (checksums verified), and every complete layer is scattered into
the reserved room on the engine thread. `wait` returns once every layer is in, or raises the
reason it never will be.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.state_codec import decode
from splitserve.state import Chunk
from splitserve.state.client import StateStoreClient


class StateReader:
    """Owns one Get stream and its thread; counts the layer states it delivered."""

    def __init__(
        self,
        loop: EngineLoop,
        store: StateStoreClient,
        request_id: str,
        key: str,
        num_states: int,
        timeout_s: float,
        on_failure: Callable[[StateReader], None] | None = None,
    ) -> None:
        self.loop, self.request_id, self.key = loop, request_id, key
        self.num_states = num_states
        self.num_received = 0
        self.num_bytes = 0
        self.error: BaseException | None = None
        self.first_chunk_at: float | None = None
        self.done_at: float | None = None
        self._done = threading.Event()
        self._on_failure = on_failure
        # The store holds the Get open until the prefill's first put creates the key.
        self._stream = store.get(key, timeout_s=timeout_s, wait_for_key=True)
        threading.Thread(target=self._pull, name=f"state-reader-{request_id}", daemon=True).start()

    def wait(self, timeout_s: float) -> None:
        """Returns once every layer is in; raises the store's error (`StateStoreError`, e.g.
        `CorruptStateError`), `TimeoutError`, or `RuntimeError` (cancelled, or the state fell short)."""
        if not self._done.wait(timeout_s):
            self.cancel()
            raise TimeoutError(f"state of {self.request_id} did not arrive within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Ends the Get from any thread; `wait` then raises."""
        self._stream.cancel()

    def _pull(self) -> None:
        rid = self.request_id
        try:
            for state in decode(self._count(self._stream)):
                self.loop.call(
                    functools.partial(LLMEngine.write_transferred_state, request_id=rid, state=state)
                ).result()
                self.num_received += 1
            if self.num_received != self.num_states:
                raise RuntimeError(
                    f"state of {rid} ended after {self.num_received} of {self.num_states} layer states"
                )
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
