"""The Reserve → Prefill → Decode flow over real gRPC, as the gateway drives it."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from splitserve.rpc import make_channel
from splitserve.sampling_params import SamplingParams
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from splitserve.wire import FINISH_FROM_PROTO, decode_request, prefill_request, sampling_params_to_proto


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    timing: prefill_pb2.PrefillTiming | None = None  # the prefill's report


def reserve(decode_address: str, request_id: str, prompt: list[int]) -> decode_pb2.ReserveResponse:
    with make_channel(decode_address) as dc:
        reserved = decode_pb2_grpc.DecodeStub(dc).Reserve(
            decode_pb2.ReserveRequest(request_id=request_id, num_prompt_tokens=len(prompt), timeout_s=30),
            timeout=30,
        )
    assert reserved.accepted, reserved.reject_reason
    return reserved


def generate(
    prefill_address: str,
    decode_address: str,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    reserved: decode_pb2.ReserveResponse | None = None,
) -> Result:
    """The whole flow; with `reserved`, the decode room was already reserved for `request_id`."""
    if reserved is None:
        reserved = reserve(decode_address, request_id, prompt)
    with make_channel(prefill_address) as pc, make_channel(decode_address) as dc:
        prefill, decode = prefill_pb2_grpc.PrefillStub(pc), decode_pb2_grpc.DecodeStub(dc)
        sp = sampling_params_to_proto(params)
        request = prefill_request(request_id, prompt, sp, reserved)
        try:
            first = prefill.Prefill(request, timeout=60)
        except grpc.RpcError:
            decode.Abort(
                decode_pb2.AbortDecodeRequest(request_id=request_id), timeout=30
            )  # as the gateway does
            raise
        result = Result([first.first_token_id], FINISH_FROM_PROTO[first.finish_reason], first.timing)
        if result.finish_reason is not None:
            decode.Abort(decode_pb2.AbortDecodeRequest(request_id=request_id), timeout=30)
            return result
        stream = decode.Decode(decode_request(request_id, prompt, sp, first), timeout=60)
        for delta in stream:
            result.token_ids += list(delta.token_ids)
            result.finish_reason = FINISH_FROM_PROTO[delta.finish_reason]
        return result
