"""Engine updates of one request -> the TokenDelta messages of a Decode stream."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import grpc

from splitserve.rpc import abort
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
    samples: Mapping[int, int] | None = None,
    *,
    engine_alive: Callable[[], bool],
) -> Iterator[decode_pb2.TokenDelta]:
    """One TokenDelta per engine update until the finishing one; `on_finish` runs just before it.

    Ends quietly once the RPC is no longer active (the client cancelled, the server stopped):
    an aborted request sends no further update, and a handler left waiting for one would hold
    a server thread for ever. Ends with UNAVAILABLE, which the gateway takes as a lost worker and
    fails over at once, when `engine_alive()` says the engine loop died (a tensor-parallel rank
    lost, a step that raised): no update will come here again, and the controller may take a
    while to replace the worker.

    `num_generated`: tokens generated before the stream's first update (the prefill's first
    token, plus those generated elsewhere before a decode failover).

    `samples`, for a request of several samples (n > 1): the sample indexes this stream carries,
    each with its tokens generated before the stream. Each delta names its sample; the stream
    ends after the last of them finishes (updates of other samples are not sent).
    """
    generated = dict(samples) if samples is not None else {0: num_generated}
    unseen = set(generated)  # samples whose first delta is still to come
    first = True
    while generated:
        try:
            update = updates.get(timeout=_LIVENESS_CHECK_S)
        except queue.Empty:
            if not context.is_active():
                return
            if not engine_alive():
                abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"this worker's engine stopped; request {rid} cannot go on here",
                )
            continue
        index = update.request.sample_index
        if index not in generated:
            continue
        generated[index] += len(update.new_token_ids)
        delta = decode_pb2.TokenDelta(
            request_id=rid,
            sample_index=index,
            token_ids=update.new_token_ids,
            logprobs=[logprobs_to_proto(lp) for lp in update.new_logprobs],
            finish_reason=FINISH_TO_PROTO[update.finish_reason if update.finished else None],
            num_generated_tokens=generated[index],
            num_cached_tokens=update.num_cached_tokens if index in unseen else 0,
            timing=decode_pb2.DecodeTiming(
                emit_unix_s=time.time(),
                state_wait_s=state_wait_s if first else 0.0,
                queue_s=update.queue_s or 0.0,  # set on the first update since admission only
            ),
        )
        first = False
        unseen.discard(index)
        if update.finished:
            if isinstance(update.stop_reason, int):
                delta.stop_token_id = update.stop_reason
            del generated[index]
            if not generated:
                on_finish()
        yield delta
