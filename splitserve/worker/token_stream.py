"""Engine updates of one request -> the TokenDelta messages of a Decode stream."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc

from splitserve.v1 import decode_pb2
from splitserve.wire import FINISH_TO_PROTO, logprobs_to_proto

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import RequestUpdate

# How often a stream waiting for its next update checks that its RPC is still alive.
_LIVENESS_CHECK_S = 1.0


def stream_deltas(
    rid: str,
    updates: queue.Queue[RequestUpdate],
    on_finish: Callable[[], None],
    context: grpc.ServicerContext,
    state_wait_s: float = 0.0,
    num_generated: int = 1,
) -> Iterator[decode_pb2.TokenDelta]:
    """One TokenDelta per engine update until the finishing one; `on_finish` runs just before it.

    Ends quietly once the RPC is no longer active (the client cancelled, the server stopped):
    an aborted request sends no further update, and a handler left waiting for one would hold
    a server thread for ever. `num_generated`: tokens generated before the stream's first update
    (the prefill's first token, plus those generated elsewhere before a decode failover).
    """
    first = True
    while True:
        try:
            update = updates.get(timeout=_LIVENESS_CHECK_S)
        except queue.Empty:
            if not context.is_active():
                return
            continue
        num_generated += len(update.new_token_ids)
        delta = decode_pb2.TokenDelta(
            request_id=rid,
            token_ids=update.new_token_ids,
            logprobs=[logprobs_to_proto(lp) for lp in update.new_logprobs],
            finish_reason=FINISH_TO_PROTO[update.finish_reason if update.finished else None],
            num_generated_tokens=num_generated,
            num_cached_tokens=update.num_cached_tokens if first else 0,
            timing=decode_pb2.DecodeTiming(
                emit_unix_s=time.time(),
                state_wait_s=state_wait_s if first else 0.0,
                queue_s=update.queue_s or 0.0,  # set on the first update since admission only
            ),
        )
        first = False
        if update.finished:
            if isinstance(update.stop_reason, int):
                delta.stop_token_id = update.stop_reason
            on_finish()
        yield delta
        if update.finished:
            return
