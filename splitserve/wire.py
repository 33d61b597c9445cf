"""Conversions between splitserve's Python types and the protobuf messages of `proto/`. Torch-free.

One place for every field mapping, so the frontend and the workers cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.sampling_params import SamplingParams
from splitserve.v1 import common_pb2, decode_pb2, prefill_pb2

FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.max_tokens is not None:
        msg.max_tokens = params.max_tokens
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.best_of is not None:
        msg.best_of = params.best_of
    return msg


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Validated on the way in: a bad value raises ValueError naming the field."""
    return SamplingParams(
        n=msg.n or 1,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        min_tokens=msg.min_tokens,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        skip_special_tokens=msg.skip_special_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        best_of=msg.best_of if msg.HasField("best_of") else None,
    )


def logprobs_to_proto(entry: dict[int, float] | None) -> common_pb2.TokenLogprobs:
    entry = entry or {}
    return common_pb2.TokenLogprobs(token_ids=list(entry), logprobs=list(entry.values()))


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> dict[int, float]:
    return dict(zip(msg.token_ids, msg.logprobs))


def prefill_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: common_pb2.SamplingParams,
    reservation: decode_pb2.ReserveResponse | None = None,
    lease_s: float = 0.0,
    prefix_hashes: Sequence[bytes] = (),
) -> prefill_pb2.PrefillRequest:
    """Prefill of a prompt whose state goes where `reservation` says (None: max_tokens 1, no state).

    `prefix_hashes` is the prompt's prefix chain (empty: the engine hashes the prompt itself)."""
    request = prefill_pb2.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=params,
        lease_s=lease_s,
        prefix_hashes=prefix_hashes,
    )
    if reservation is not None:
        request.store_address = reservation.store_address
        request.state_key = reservation.state_key
        request.state_owner = reservation.state_owner
    return request


def decode_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: common_pb2.SamplingParams,
    first: prefill_pb2.PrefillResponse,
) -> decode_pb2.DecodeRequest:
    """Decode of a prefilled request, from the prefill's first token (and logprobs) and state handle."""
    return decode_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=params,
        first_token_id=first.first_token_id,
        first_logprobs=first.first_logprobs,
        state=first.state,
    )
