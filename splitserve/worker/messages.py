"""Messages every worker servicer reads or builds the same way: a request's sampling parameters
(refused with INVALID_ARGUMENT when bad) and the PrefillResponse carrying a first token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from splitserve.rpc import abort
from splitserve.sampling_params import SamplingParams
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


def first_token_response(
    update: RequestUpdate, finish_reason: str | None, timing: prefill_pb2.PrefillTiming
) -> prefill_pb2.PrefillResponse:
    """The reply to Prefill from the request's first update: its token (and logprobs), and, when
    `finish_reason` says the request already ended, the stop token that ended it. No state handle."""
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
