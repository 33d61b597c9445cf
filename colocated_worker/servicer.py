"""The colocated servicer (`mode: colocated`): Prefill and Decode services on one engine.

The gateway drives the same Reserve → Prefill → Decode flow, but no state moves: Prefill runs
an ordinary request and returns its first token, and Decode streams the rest of that same
request from the engine (of each of its samples, n > 1: the engine forks them from the one
prompt). This is the baseline disaggregation is measured against.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc

from splitserve.engine.llm_engine import RequestUpdate
from splitserve.rpc import abort
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from splitserve.worker.cache_report import CacheReporter
from splitserve.worker.load import decode_stats
from splitserve.worker.messages import (
    first_token_response,
    sample_ids,
    sample_start,
    sampling_params_or_abort,
)
from splitserve.worker.token_stream import stream_deltas


class _Stream:
    """Updates of one request (of each of its samples, n > 1: `ids`), from the first tokens on:
    Prefill answers with the first update of each, Decode drains the rest."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self.updates: queue.Queue[RequestUpdate] = queue.Queue()
        self.first = threading.Event()
        self.first_updates: dict[int, RequestUpdate] = {}  # by sample index

    def push(self, update: RequestUpdate) -> None:
        index = update.request.sample_index
        if index not in self.first_updates:
            self.first_updates[index] = update
            if len(self.first_updates) == len(self.ids):
                self.first.set()
        else:
            self.updates.put(update)


class ColocatedServicer(prefill_pb2_grpc.PrefillServicer, decode_pb2_grpc.DecodeServicer):
    """Owns the per-request update streams between a Prefill call and its Decode call."""

    def __init__(self, loop, worker_id: str, request_timeout_s: float = 300.0) -> None:  # type: ignore[no-untyped-def]
        self.loop = loop
        self.worker_id = worker_id
        self.request_timeout_s = request_timeout_s
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._cache_reporter = CacheReporter()

    def Reserve(
        self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext
    ) -> decode_pb2.ReserveResponse:
        # A hint, from the engine's last pass (no wait behind a long step): Prefill adds the
        # request either way, and the engine queues it if the room went meanwhile.
        snap = self.loop.snapshot()
        num_samples = max(1, request.num_samples)  # each decodes in a slot of its own
        if num_samples > snap.max_num_seqs:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{num_samples} samples need as many state slots; this worker runs at most "
                f"{snap.max_num_seqs} requests (max_num_seqs)",
            )
        has_room = snap.num_running + snap.num_reserved + num_samples <= snap.max_num_seqs
        if not has_room:
            return decode_pb2.ReserveResponse(
                accepted=False, reject_reason="max_num_seqs requests already running"
            )
        return decode_pb2.ReserveResponse(
            accepted=True, state_key=request.request_id, state_owner=self.worker_id
        )

    def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        arrival = time.time()
        rid = request.request_id
        params = sampling_params_or_abort(request.sampling_params, context)
        stream = _Stream(sample_ids(rid, params))
        with self._lock:
            self._streams[rid] = stream
        for engine_id in stream.ids:
            self.loop.watch(engine_id, stream.push)
        prompt, sent = list(request.prompt_token_ids), list(request.output_token_ids)  # sent: failover
        chain = list(request.prefix_hashes) or None  # None: the engine hashes the prompt itself
        started = time.time()
        try:
            self.loop.call(
                lambda e: e.add_request(rid, prompt, params, output_token_ids=sent, prefix_hashes=chain)
            ).result(timeout=30)
        except ValueError as exc:
            self._forget(rid)
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not stream.first.wait(self.request_timeout_s):
            self._abort(rid)
            abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid} did not finish in time")
        updates = [stream.first_updates[i] for i in range(len(stream.ids))]
        update = updates[0]
        queue_s = update.queue_s or 0.0
        finished = all(u.finished for u in updates)
        if finished:
            self._forget(rid)
        if any(u.finish_reason == "abort" for u in updates):
            abort(context, grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
        timing = prefill_pb2.PrefillTiming(
            arrival_unix_s=arrival, queue_s=queue_s, prefill_s=max(0.0, time.time() - started - queue_s)
        )
        response = first_token_response(update, update.finish_reason if finished else None, timing)
        if len(updates) > 1:
            response.samples.extend(sample_start(u, u.finish_reason if u.finished else None) for u in updates)
        if not finished:
            response.state.key = rid
            response.state.owner = self.worker_id
        return response

    def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.TokenDelta]:
        rid = request.request_id
        with self._lock:
            stream = self._streams.get(rid)
        if stream is None:
            abort(
                context, grpc.StatusCode.NOT_FOUND, f"request {rid!r} is not running here; call Prefill first"
            )
        done = threading.Event()
        context.add_callback(lambda: None if done.is_set() else self._abort(rid))

        def finish() -> None:
            done.set()
            self._forget(rid)

        num_generated = 1 + len(request.output_token_ids)  # the first token, plus any before a failover
        live = {i: num_generated for i, u in stream.first_updates.items() if not u.finished}
        for i, start in enumerate(request.samples):  # samples the gateway ended (a stop string)
            if start.finish_reason and i in live:
                del live[i]
                self.loop.call(lambda e, engine_id=stream.ids[i]: e.abort_request(engine_id))
        yield from stream_deltas(
            rid, stream.updates, finish, context, samples=live, engine_alive=lambda: self.loop.alive
        )

    def _forget(self, rid: str) -> None:
        with self._lock:
            stream = self._streams.pop(rid, None)
        for engine_id in stream.ids if stream is not None else [rid]:
            self.loop.unwatch(engine_id)

    def _abort(self, rid: str) -> None:
        self._forget(rid)
        self.loop.call(lambda e: e.abort_request(rid))

    def Abort(self, request, context):  # type: ignore[no-untyped-def]
        rid = request.request_id
        found = self.loop.call(lambda e: e.has_request(rid)).result(timeout=30)
        self._abort(rid)
        if isinstance(request, prefill_pb2.AbortPrefillRequest):
            return prefill_pb2.AbortPrefillResponse(found=found)
        return decode_pb2.AbortDecodeResponse(found=found)

    def Stats(
        self, request: decode_pb2.DecodeStatsRequest, context: grpc.ServicerContext
    ) -> decode_pb2.DecodeStats:
        return decode_stats(self.loop.snapshot())  # the last pass's: no wait behind a step

    def CacheReport(
        self, request: prefill_pb2.CacheReportRequest, context: grpc.ServicerContext
    ) -> prefill_pb2.PrefixCacheReport:
        return self._cache_reporter.report(self.loop, request)  # no wait behind a step
