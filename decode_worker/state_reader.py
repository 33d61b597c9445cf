"""Pulls one reserved request's state from the store while the prefill is still writing it.

Started when the decode worker accepts a reservation: the store's Get streams each chunk as it
lands, and every complete layer is scattered into the reserved room on the engine thread.
`wait` returns once every layer is in, or raises the reason it never will be.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import grpc

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.state_codec import CorruptStateError, decode
from splitserve.v1 import store_pb2, store_pb2_grpc


class StateReader:
    """Owns one Get stream and its thread; counts the layer states it delivered."""

    def __init__(
        self,
        loop: EngineLoop,
        stub: store_pb2_grpc.StateStoreStub,
        request_id: str,
        key: str,
        num_states: int,
        timeout_s: float,
        on_failure: Callable[[StateReader], None] | None = None,
    ) -> None:
        self.loop, self.stub, self.request_id, self.key = loop, stub, request_id, key
        self.num_states = num_states
        self.timeout_s = timeout_s
        self.num_received = 0
        self.num_bytes = 0
        self.error: BaseException | None = None
        self.first_chunk_at: float | None = None
        self.done_at: float | None = None
        self._done = threading.Event()
        self._call: grpc.Future | None = None
        self._cancelled = False
        self._on_failure = on_failure
        threading.Thread(target=self._pull, name=f"state-reader-{request_id}", daemon=True).start()

    def wait(self, timeout_s: float) -> None:
        if not self._done.wait(timeout_s):
            self.cancel()
            raise TimeoutError(f"state of {self.request_id} did not arrive within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self._cancelled = True
        call = self._call
        if call is not None:
            call.cancel()

    def _open(self, deadline: float):  # type: ignore[no-untyped-def]
        """The Get stream; the store holds it open until the prefill's first put creates the key."""
        remaining = deadline - time.monotonic()
        request = store_pb2.GetRequest(key=self.key, timeout_s=remaining, wait_for_key=True)
        self._call = call = self.stub.Get(request, timeout=remaining)
        if self._cancelled:  # cancel() ran before the call existed
            call.cancel()
        return call

    def _pull(self) -> None:
        try:
            stream = self._open(time.monotonic() + self.timeout_s)
            rid = self.request_id
            for state in decode(self._count(stream)):
                self.loop.call(
                    functools.partial(LLMEngine.write_transferred_state, request_id=rid, state=state)
                ).result()
                self.num_received += 1
            if self.num_received != self.num_states:
                raise RuntimeError(
                    f"state of {self.request_id} ended after {self.num_received} of {self.num_states} layer states"
                )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DATA_LOSS:  # type: ignore[attr-defined]
                self.error = CorruptStateError(f"the store refused corrupt state: {exc.details()}")  # type: ignore[attr-defined]
            else:
                self.error = exc if not self._cancelled else RuntimeError("state transfer cancelled")
        except BaseException as exc:
            self.error = exc if not self._cancelled else RuntimeError("state transfer cancelled")
        finally:
            self.done_at = time.time()
            self._done.set()
            if self.error is not None and self._on_failure is not None:
                self._on_failure(self)

    def _count(self, stream):  # type: ignore[no-untyped-def]
        for chunk in stream:
            if self.first_chunk_at is None:
                self.first_chunk_at = time.time()
            self.num_bytes += len(chunk.data)
            yield chunk
