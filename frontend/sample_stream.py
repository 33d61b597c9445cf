"""One Decode stream carrying several samples' deltas, read once and handed to a view per sample.

A request of n samples decodes on one worker in one Decode call (decode_worker forks the prompt
state into every sample); each `TokenDelta` names its sample (`sample_index`). `SharedStream`
reads the call on one task and queues each delta for its sample's `SampleView`, which a sample's
`Generation` reads exactly as it would its own `DecodeStream`: a delta, None at the end, or the
call's error (a lost worker: every sample still running fails over on its own).
"""

from __future__ import annotations

import asyncio
import contextlib

from frontend.clients import DecodeStream
from frontend.errors import GatewayError
from splitserve.v1 import decode_pb2

_END = None  # what a view reads once the call ended before its sample finished


class SampleView(DecodeStream):
    """One sample's part of a `SharedStream`, read like a `DecodeStream` (by one task): it is
    one to whatever reads a sample's stream (`failover.read_delta`), holding no call of its own."""

    def __init__(self, shared: SharedStream, index: int) -> None:  # holds no call: not super().__init__
        self.shared = shared
        self.index = index
        self.address = shared.stream.address
        self.finished = False  # its last delta was queued
        self.closed = False  # its reader let go (`cancel`)
        self._queue: asyncio.Queue[decode_pb2.TokenDelta | GatewayError | None] = asyncio.Queue()

    async def read(self) -> decode_pb2.TokenDelta | None:
        """The sample's next delta; None when the call ended without it; the call's error."""
        item = await self._queue.get()
        if isinstance(item, GatewayError):
            raise item
        return item

    def cancel(self) -> None:
        """This sample reads no more (it finished, stopped on a stop string, or failed over); the
        call is cancelled once no sample reads it."""
        self.closed = True
        self.shared.view_closed()

    def put(self, item: decode_pb2.TokenDelta | GatewayError | None) -> None:
        if not self.closed:
            self._queue.put_nowait(item)


class SharedStream:
    """Owns one Decode call of several samples and the task reading it; `close` ends both.

    Promises: every delta reaches its sample's view in order; when the call fails or ends early,
    every view whose sample had not finished reads that error (or the end) next.
    """

    def __init__(
        self,
        stream: DecodeStream,
        indexes: list[int],
        first: decode_pb2.TokenDelta | None = None,
    ) -> None:
        self.stream = stream
        self.views = {i: SampleView(self, i) for i in indexes}
        if first is not None:  # read already (a refusal shows on the first read)
            self._dispatch(first)
        self._task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        try:
            while not all(v.finished or v.closed for v in self.views.values()):
                delta = await self.stream.read()
                if delta is None:
                    self._fail(_END)
                    return
                self._dispatch(delta)
        except GatewayError as exc:
            self._fail(exc)
        finally:
            self.stream.cancel()  # ends the call's bookkeeping (a call that completed is untouched)

    def _dispatch(self, delta: decode_pb2.TokenDelta) -> None:
        view = self.views.get(delta.sample_index)
        if view is None or view.finished:
            return  # a sample this stream does not carry: nothing reads it
        view.put(delta)
        view.finished = delta.finish_reason != 0

    def _fail(self, outcome: GatewayError | None) -> None:
        for view in self.views.values():
            if not view.finished:
                view.put(outcome)

    def view_closed(self) -> None:
        if all(v.closed or v.finished for v in self.views.values()):
            self._task.cancel()

    async def close(self) -> None:
        """End the call and the reading task (whatever the samples still wanted)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
