"""Messages every worker servicer reads or builds the same way: a request's sampling parameters
(refused with INVALID_ARGUMENT when bad), the PrefillResponse carrying a first token, and the
engine ids and first tokens of a request's samples."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from splitserve.rpc import abort
from splitserve.sampling_params import SamplingParams, sample_request_id
from splitserve.v1 import common_pb2, prefill_pb2
from splitserve.wire import FINISH_TO_PROTO, logprobs_to_proto, sampling_params_from_proto

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import RequestUpdate


def sampling_params_or_abort(msg: common_pb2.SamplingParams, context: grpc.ServicerContext) -> SamplingParams:
    """The request's parameters; a bad value ends the RPC with INVALID_ARGUMENT naming the field."""
    try:
        return sampling_params_from_proto(msg)
    except ValueError as exc:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def sample_ids(request_id: str, params: SamplingParams) -> list[str]:
    """The engine ids a request's updates come under: its own, or each sample's (n > 1)."""
    if params.num_samples == 1:
        return [request_id]
    return [sample_request_id(request_id, i) for i in range(params.num_samples)]


def sample_start(update: RequestUpdate, finish_reason: str | None) -> common_pb2.SampleStart:
    """A sample's first token from its first update, finished with `finish_reason` (or not)."""
    start = common_pb2.SampleStart(
        token_id=update.new_token_ids[0], finish_reason=FINISH_TO_PROTO[finish_reason]
    )
    if update.new_logprobs:
        start.logprobs.CopyFrom(logprobs_to_proto(update.new_logprobs[0]))
    if finish_reason is not None and isinstance(update.stop_reason, int):
        start.stop_token_id = update.stop_reason
    return start


def first_token_response(
    update: RequestUpdate, finish_reason: str | None, timing: prefill_pb2.PrefillTiming
) -> prefill_pb2.PrefillResponse:
    """The reply to Prefill from the request's first update: its token (and logprobs), and, when
    `finish_reason` says the request already ended, the stop token that ended it. No state handle.
    A request of several samples adds each one's (`PrefillResponse.samples`) itself."""
    request = update.request
    response = prefill_pb2.PrefillResponse(
        request_id=request.request_id,
        first_token_id=update.new_token_ids[0],
        finish_reason=FINISH_TO_PROTO[finish_reason],
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=update.num_cached_tokens,
        timing=timing,
    )
    if update.new_logprobs:
        response.first_logprobs.CopyFrom(logprobs_to_proto(update.new_logprobs[0]))
    if finish_reason is not None and isinstance(update.stop_reason, int):
        response.stop_token_id = update.stop_reason
    return response
