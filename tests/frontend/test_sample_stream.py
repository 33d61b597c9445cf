"""One Decode call of several samples, read once: each sample's view gets its deltas in order;
when the call fails, every sample still running reads the failure (and fails over on its own);
the call is cancelled once no sample reads it."""

from __future__ import annotations

import asyncio

import pytest

from frontend.errors import GatewayError
from frontend.sample_stream import SharedStream
from splitserve.v1 import common_pb2, decode_pb2

STOP = common_pb2.FINISH_REASON_STOP


class ScriptedCall:
    """Stands in for a `DecodeStream`: hands out `script` (a GatewayError in it is raised), then
    waits for ever, as a live call with nothing to send does."""

    address = "127.0.0.1:1"

    def __init__(self, script: list[decode_pb2.TokenDelta | GatewayError]) -> None:
        self.script = list(script)
        self.cancelled = asyncio.Event()

    async def read(self) -> decode_pb2.TokenDelta | None:
        if not self.script:
            await asyncio.Event().wait()
        item = self.script.pop(0)
        if isinstance(item, GatewayError):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled.set()


def _delta(index: int, token: int, finish: int = 0) -> decode_pb2.TokenDelta:
    return decode_pb2.TokenDelta(sample_index=index, token_ids=[token], finish_reason=finish)


async def _tokens(view, count: int) -> list[int]:  # type: ignore[no-untyped-def]
    return [(await view.read()).token_ids[0] for _ in range(count)]


def test_each_sample_reads_its_own_deltas_in_order():
    async def run() -> None:
        call = ScriptedCall(
            [_delta(1, 10), _delta(0, 20), _delta(1, 11, STOP), _delta(0, 21), _delta(0, 22, STOP)]
        )
        shared = SharedStream(call, [0, 1], first=_delta(0, 19))  # type: ignore[arg-type]
        assert await _tokens(shared.views[0], 4) == [19, 20, 21, 22]
        assert await _tokens(shared.views[1], 2) == [10, 11]
        await asyncio.wait_for(call.cancelled.wait(), 5)  # both finished: the call's bookkeeping ends
        await shared.close()

    asyncio.run(run())


def test_a_failed_call_reaches_every_sample_still_running():
    async def run() -> None:
        lost = GatewayError(503, "decode worker gone", code="worker_error")
        call = ScriptedCall([_delta(0, 5, STOP), _delta(1, 6), lost])
        shared = SharedStream(call, [0, 1, 2])  # type: ignore[arg-type]
        assert await _tokens(shared.views[0], 1) == [5]
        assert await _tokens(shared.views[1], 1) == [6]
        for index in (1, 2):
            with pytest.raises(GatewayError, match="gone"):
                await asyncio.wait_for(shared.views[index].read(), 5)
        assert shared.views[0]._queue.empty(), "a finished sample reads nothing more"
        await shared.close()

    asyncio.run(run())


def test_the_call_is_cancelled_once_no_sample_reads_it():
    async def run() -> None:
        call = ScriptedCall([_delta(0, 1), _delta(1, 2)])
        shared = SharedStream(call, [0, 1])  # type: ignore[arg-type]
        await _tokens(shared.views[0], 1)
        shared.views[0].cancel()  # a stop string ended it here
        assert not call.cancelled.is_set()
        shared.views[1].cancel()
        await asyncio.wait_for(call.cancelled.wait(), 5)
        await shared.close()

    asyncio.run(run())
