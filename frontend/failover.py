"""Decode failover: a stream whose decode worker is lost goes on, exactly, on another worker.

A decode stream is lost when its RPC breaks with UNAVAILABLE or CANCELLED from the server's
side (the worker's process died or its server stopped; a worker that health checks find hung
is killed and restarted by the controller, which breaks its streams the same way), or when the
worker ends it without a finish reason. Two ways to go on, tried in this order:

* From stored state (method `stored_state`): a worker that keeps the request's state in its
  node's store as it decodes (`decode.replay_window` > 0) named where in the stream's first
  delta (`TokenDelta.resume_from`). When a process dies its node's store survives, so the
  gateway sends another decode worker a Decode with that `resume_from` and every token sent so
  far; it rebuilds the state from the prompt state and the ReplaySSM pieces
  (decode_worker/resume.py), recomputes only the tokens sent after the last piece, and streams
  on. When that fails (the state is gone with its node, a piece is corrupt, no room) it counts
  as `failed` with this method and the gateway re-prefills.
* By re-prefill (method `reprefill`): the request is routed again as if it were new (a
  reservation on a decode worker that answers, a prefill), except that the prefill runs prompt +
  every token the lost worker produced (`PrefillRequest.output_token_ids`) and samples the next
  one as output index len(those). With the prefill pool empty (`prefill.fallback:
  decode_local`) the new decode worker computes prompt + those tokens itself, the same way.

Either way greedy and seeded sampling, penalties, max_tokens and the detokenizer's state continue
where the stream stopped, so the client sees no token repeated or missing. Tokens the lost worker
made but never delivered are made again, the same ones.

Bounded: at most `max_decode_failovers` lost workers per request. Finding the next worker is
tried again with a growing backoff (0.25 s doubling to 2 s) while none can take the request
(every other one full or unreachable, or the only one being restarted by the controller), for
up to `decode_failover_wait_s` and never past the request's deadline; a refusal retrying cannot
change (a 400) ends it at once. With `decode_failover` off the stream ends with a 503 (an SSE
error event when streaming). Every lost stream, and every failed try, is counted in
`splitserve_decode_failovers_total{outcome, method}`.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import grpc

from frontend.backoff import Backoff
from frontend.clients import DecodeStream
from frontend.errors import GatewayError
from frontend.metrics import GatewayMetrics
from frontend.settings import GatewaySettings
from frontend.steps import Step
from splitserve.v1 import decode_pb2

logger = logging.getLogger(__name__)

METHOD_REPREFILL = "reprefill"  # prompt + tokens sent, prefilled again
METHOD_STORED = "stored_state"  # rebuilt from the lost worker's stored prompt state + ReplaySSM pieces
_LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class WorkerLost(GatewayError):
    """The decode worker of a stream is gone (or ended the stream early): fail over."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="decode_worker_lost")


async def read_delta(stream: DecodeStream) -> decode_pb2.TokenDelta:
    """The stream's next delta; `WorkerLost` when its worker is lost, else its GatewayError."""
    try:
        delta = await stream.read()
    except GatewayError as exc:
        cause = exc.__cause__
        if isinstance(cause, grpc.aio.AioRpcError) and cause.code() in _LOST_CODES:
            raise WorkerLost(exc.message) from exc
        raise
    if delta is None:
        raise WorkerLost(f"decode worker {stream.address} ended the stream without a finish reason")
    return delta


class Resumable(Protocol):
    """What failover needs of a generation (frontend.generate.Generation)."""

    request_id: str
    resume_method: str  # how the last `resume_elsewhere` went on: METHOD_STORED or METHOD_REPREFILL

    async def resume_elsewhere(self) -> Step:
        """Drop the lost stream and go on elsewhere (from stored state, else by re-prefill); the next step."""
        ...


class DecodeFailover:
    """One generation's failovers: whether it may fail over, how many times it did, the metric.

    Not shared between generations; not safe to drive from two tasks at once (nor is the
    generation it serves).
    """

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.enabled = settings.decode_failover
        self.max_attempts = settings.max_decode_failovers
        self.wait_s = settings.decode_failover_wait_s
        self.num_attempts = 0  # decode workers this request lost
        self._metrics = metrics

    async def recover(self, gen: Resumable, lost: WorkerLost, deadline_s: float) -> Step:
        """Resume `gen` on another decode worker: its next step. Raises a 503 GatewayError when
        failover is off or exhausted, or no worker took the request within the wait (or before
        `deadline_s`, the request's, on the monotonic clock)."""
        if not self.enabled:
            self._count("disabled")
            raise GatewayError(
                503,
                f"{lost.message}; decode.failover is off, so this stream ends here: retry the request",
                code="decode_worker_lost",
            ) from lost
        if self.num_attempts >= self.max_attempts:
            self._count("exhausted")
            raise GatewayError(
                503,
                f"{lost.message}; gave up after losing {self.num_attempts} decode workers for this "
                "request: retry it",
                code="decode_worker_lost",
            ) from lost
        self.num_attempts += 1
        logger.warning(
            "request %s: %s; resuming it elsewhere (failover %d of %d)",
            gen.request_id,
            lost.message,
            self.num_attempts,
            self.max_attempts,
        )
        backoff = Backoff(min(deadline_s, time.monotonic() + self.wait_s))
        while True:
            try:
                step = await gen.resume_elsewhere()
            except GatewayError as exc:
                self._count("failed", gen.resume_method)
                if exc.status_code not in (429, 503):  # a refusal retrying cannot change
                    raise
                if not await backoff.wait():
                    raise GatewayError(
                        503,
                        f"{lost.message}; then no decode worker took the request within "
                        f"{self.wait_s:g} s (decode.failover_wait_s): {exc.message}",
                        code="decode_worker_lost",
                    ) from exc
                continue
            self._count("resumed", gen.resume_method)
            return step

    def stored_state_failed(self) -> None:
        """A resume from stored state did not work out (the generation re-prefills instead)."""
        self._count("failed", METHOD_STORED)

    def _count(self, outcome: str, method: str = METHOD_REPREFILL) -> None:
        metrics = self._metrics
        metrics.decode_failovers.labels(metrics.model_name, outcome, method).inc()
