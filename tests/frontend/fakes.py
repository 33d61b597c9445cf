"""Test doubles for the workers: fake Prefill and Decode servicers on real gRPC servers.

The prefill fake returns `script[0]` as the first token; the decode fake streams the rest of
the script one token per delta, then EOS. A resumed request (decode failover: k
`output_token_ids`) continues the script at position k in both. Both record every request
and every Abort, and the decode fake stops a stream when its request is aborted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import grpc

from splitserve import rpc
from splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

EOS_TOKEN_ID = 2
STORE_ADDRESS = "127.0.0.1:1"  # never dialled by the fakes; the gateway only passes it on


def fake_logprobs(token_id: int, num_top: int | None, position: int) -> common_pb2.TokenLogprobs | None:
    """Sampled token first and ranked top; then num_top - 1 others, each 1 nat lower."""
    if num_top is None:
        return None
    ids = [token_id] + [token_id + 100 + i for i in range(max(num_top - 1, 0))]
    logprobs = [-0.25 - 0.01 * position - i for i in range(len(ids))]
    return common_pb2.TokenLogprobs(token_ids=ids, logprobs=logprobs)


def _num_top(params: common_pb2.SamplingParams) -> int | None:
    return params.logprobs if params.HasField("logprobs") else None


def _num_samples(params: common_pb2.SamplingParams) -> int:
    return params.best_of if params.HasField("best_of") else max(1, params.n)


@dataclass
class Script:
    """The deterministic output both fakes follow."""

    token_ids: list[int]


@dataclass
class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    script: Script
    fail_with: grpc.StatusCode | None = None
    crash_with: Exception | None = None  # raised from Prefill: gRPC answers UNKNOWN with its text
    requests: list[prefill_pb2.PrefillRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    aborted: threading.Event = field(default_factory=threading.Event)
    hold: threading.Event | None = None  # when set to an Event: Prefill waits on it (or an abort)
    arrived: threading.Event = field(default_factory=threading.Event)

    def Prefill(self, request, context):  # noqa: N802
        self.requests.append(request)
        self.arrived.set()
        if self.fail_with is not None:
            context.abort(self.fail_with, "fake prefill failure")
        if self.crash_with is not None:
            raise self.crash_with
        if self.hold is not None:
            self.hold.wait(30)
        position = len(request.output_token_ids)  # > 0: a decode failover resumes the request
        script = self.script.token_ids
        first = script[position] if position < len(script) else EOS_TOKEN_ID
        params = request.sampling_params
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        stop_token_id = None
        if first in params.stop_token_ids or (first == EOS_TOKEN_ID and not params.ignore_eos):
            finish, stop_token_id = common_pb2.FINISH_REASON_STOP, first
        elif params.HasField("max_tokens") and params.max_tokens <= 1 + position:
            finish = common_pb2.FINISH_REASON_LENGTH
        response = prefill_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=first,
            finish_reason=finish,
            num_prompt_tokens=len(request.prompt_token_ids),
            timing=prefill_pb2.PrefillTiming(
                queue_s=0.001, prefill_s=0.002, state_put_s=0.003, state_bytes=4096, state_stream_s=0.005
            ),
        )
        if stop_token_id is not None:
            response.stop_token_id = stop_token_id
        logprobs = fake_logprobs(first, _num_top(params), position)
        if logprobs is not None:
            response.first_logprobs.CopyFrom(logprobs)
        for _ in range(_num_samples(params) if _num_samples(params) > 1 else 0):  # each the script's
            start = common_pb2.SampleStart(token_id=first, finish_reason=finish, logprobs=logprobs)
            if stop_token_id is not None:
                start.stop_token_id = stop_token_id
            response.samples.append(start)
        if finish == common_pb2.FINISH_REASON_UNSPECIFIED:
            response.state.CopyFrom(
                common_pb2.StateHandle(
                    store_address=request.store_address,
                    key=request.state_key,
                    owner=request.state_owner,
                    num_layers=6,
                )
            )
        return response

    def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request.request_id)
        self.aborted.set()
        if self.hold is not None:
            self.hold.set()
        return prefill_pb2.AbortPrefillResponse(found=True)

    def Stats(self, request, context):  # noqa: N802
        return prefill_pb2.PrefillStats()


@dataclass
class FakeDecode(decode_pb2_grpc.DecodeServicer):
    script: Script
    accept: bool = True
    stats: decode_pb2.DecodeStats = field(
        default_factory=lambda: decode_pb2.DecodeStats(
            max_num_seqs=8,
            num_free_kv_blocks=100,
            num_total_kv_blocks=100,
            num_free_state_slots=8,
            num_total_state_slots=8,
        )
    )
    hang_after: int | None = None  # stream this many deltas, then wait until aborted
    fail_after: int | None = None  # stream this many deltas, then fail the RPC with INTERNAL
    reserves: list[decode_pb2.ReserveRequest] = field(default_factory=list)
    decodes: list[decode_pb2.DecodeRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    aborted: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)  # a Decode arrived
    num_stats_calls: int = 0
    hold_reserve: threading.Event | None = None  # when set to an Event: Reserve waits on it
    _wake: dict[str, threading.Event] = field(default_factory=dict)  # abort or cancel
    _abort_cond: threading.Condition = field(default_factory=threading.Condition)

    def wait_for_aborts(self, count: int, timeout_s: float = 10.0) -> bool:
        """True once at least `count` Aborts arrived."""
        with self._abort_cond:
            return self._abort_cond.wait_for(lambda: len(self.aborts) >= count, timeout_s)

    def _wake_event(self, request_id: str) -> threading.Event:
        return self._wake.setdefault(request_id, threading.Event())

    def Reserve(self, request, context):  # noqa: N802
        self.reserves.append(request)
        if self.hold_reserve is not None:
            self.hold_reserve.wait(30)
        if not self.accept:
            return decode_pb2.ReserveResponse(accepted=False, reject_reason="no free state slots")
        return decode_pb2.ReserveResponse(
            accepted=True,
            store_address=STORE_ADDRESS,
            state_key=f"state-{request.request_id}",
            state_owner=f"owner-{request.request_id}",
            expiry_unix_s=1e12,
        )

    def Decode(self, request, context):  # noqa: N802
        self.decodes.append(request)
        self.started.set()
        params = request.sampling_params
        if not request.HasField("state"):  # computes its prompt: an Abort of an earlier room is past
            self._wake[request.request_id] = threading.Event()
        wake = self._wake_event(request.request_id)
        context.add_callback(wake.set)
        max_tokens = params.max_tokens if params.HasField("max_tokens") else 10**9
        script = self.script.token_ids
        # n > 1: every sample the Decode names as running (or, without state, every sample),
        # each following the script, one delta per sample and position
        samples = [i for i, start in enumerate(request.samples) if not start.finish_reason]
        if not request.samples:
            samples = list(range(_num_samples(params)))
        for position in range(1 + len(request.output_token_ids), max_tokens):
            if self.fail_after is not None and position > self.fail_after:
                context.abort(grpc.StatusCode.INTERNAL, "fake decode worker crashed")
            if self.hang_after is not None and position > self.hang_after:
                wake.wait(30)
            if wake.is_set() or not context.is_active():
                for index in samples:
                    yield decode_pb2.TokenDelta(
                        request_id=request.request_id,
                        finish_reason=common_pb2.FINISH_REASON_ABORT,
                        sample_index=index,
                    )
                return
            token = script[position] if position < len(script) else EOS_TOKEN_ID
            for index in samples:
                delta = decode_pb2.TokenDelta(
                    request_id=request.request_id,
                    token_ids=[token],
                    num_generated_tokens=position + 1,
                    sample_index=index,
                )
                if position == 1:
                    delta.timing.CopyFrom(decode_pb2.DecodeTiming(state_wait_s=0.004, queue_s=0.005))
                logprobs = fake_logprobs(token, _num_top(params), position)
                if logprobs is not None:
                    delta.logprobs.append(logprobs)
                if token == EOS_TOKEN_ID and not params.ignore_eos:
                    delta.finish_reason = common_pb2.FINISH_REASON_STOP
                    delta.stop_token_id = token
                elif position == max_tokens - 1:
                    delta.finish_reason = common_pb2.FINISH_REASON_LENGTH
                yield delta
            if token == EOS_TOKEN_ID and not params.ignore_eos:
                return
        return

    def Abort(self, request, context):  # noqa: N802
        with self._abort_cond:
            self.aborts.append(request.request_id)
            self._abort_cond.notify_all()
        self._wake_event(request.request_id).set()
        self.aborted.set()
        return decode_pb2.AbortDecodeResponse(found=True)

    def Stats(self, request, context):  # noqa: N802
        self.num_stats_calls += 1
        return self.stats


@dataclass
class FakeStore(store_pb2_grpc.StateStoreServicer):
    """A store that only records the keys the gateway releases."""

    released: list[str] = field(default_factory=list)

    def Release(self, request, context):  # noqa: N802
        self.released.append(request.key)
        return store_pb2.ReleaseResponse(num_keys=1)


class FakeWorkerServer:
    """A real gRPC server on 127.0.0.1 (free port) hosting fake servicers (both: a colocated worker)."""

    def __init__(self, *servicers: FakePrefill | FakeDecode | FakeStore) -> None:
        self.server = rpc.make_server(max_workers=16)  # the workers' options, keepalive policy included
        for servicer in servicers:
            if isinstance(servicer, FakeStore):
                store_pb2_grpc.add_StateStoreServicer_to_server(servicer, self.server)
            elif isinstance(servicer, FakePrefill):
                prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, self.server)
            else:
                decode_pb2_grpc.add_DecodeServicer_to_server(servicer, self.server)
        rpc.add_health(self.server)  # as every worker's server answers it (the gateway polls it)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None).wait(10)
