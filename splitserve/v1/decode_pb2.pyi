from splitserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "timeout_s", "source_store_address", "state_key", "num_samples")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SOURCE_STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    timeout_s: float
    source_store_address: str
    state_key: str
    num_samples: int
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., timeout_s: _Optional[float] = ..., source_store_address: _Optional[str] = ..., state_key: _Optional[str] = ..., num_samples: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("accepted", "reject_reason", "store_address", "state_key", "state_owner", "expiry_unix_s")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECT_REASON_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_OWNER_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reject_reason: str
    store_address: str
    state_key: str
    state_owner: str
    expiry_unix_s: float
    def __init__(self, accepted: _Optional[bool] = ..., reject_reason: _Optional[str] = ..., store_address: _Optional[str] = ..., state_key: _Optional[str] = ..., state_owner: _Optional[str] = ..., expiry_unix_s: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "first_token_id", "first_logprobs", "state", "output_token_ids", "resume_from", "max_uncached_tokens", "prefix_hashes", "samples")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    MAX_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    state: _common_pb2.StateHandle
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_from: ResumeFrom
    max_uncached_tokens: int
    prefix_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.SampleStart]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.StateHandle, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., resume_from: _Optional[_Union[ResumeFrom, _Mapping]] = ..., max_uncached_tokens: _Optional[int] = ..., prefix_hashes: _Optional[_Iterable[bytes]] = ..., samples: _Optional[_Iterable[_Union[_common_pb2.SampleStart, _Mapping]]] = ...) -> None: ...

class ResumeFrom(_message.Message):
    __slots__ = ("store_address", "state_key")
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_KEY_FIELD_NUMBER: _ClassVar[int]
    store_address: str
    state_key: str
    def __init__(self, store_address: _Optional[str] = ..., state_key: _Optional[str] = ...) -> None: ...

class DecodeTiming(_message.Message):
    __slots__ = ("emit_unix_s", "state_wait_s", "queue_s")
    EMIT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    STATE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    emit_unix_s: float
    state_wait_s: float
    queue_s: float
    def __init__(self, emit_unix_s: _Optional[float] = ..., state_wait_s: _Optional[float] = ..., queue_s: _Optional[float] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "stop_token_id", "num_generated_tokens", "timing", "resume_from", "num_cached_tokens", "sample_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    num_generated_tokens: int
    timing: DecodeTiming
    resume_from: ResumeFrom
    num_cached_tokens: int
    sample_index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., timing: _Optional[_Union[DecodeTiming, _Mapping]] = ..., resume_from: _Optional[_Union[ResumeFrom, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., sample_index: _Optional[int] = ...) -> None: ...

class AbortDecodeRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortDecodeResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DecodeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeStats(_message.Message):
    __slots__ = ("num_running_seqs", "num_reserved", "max_num_seqs", "num_free_kv_blocks", "num_total_kv_blocks", "num_free_state_slots", "num_total_state_slots")
    NUM_RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    num_running_seqs: int
    num_reserved: int
    max_num_seqs: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_free_state_slots: int
    num_total_state_slots: int
    def __init__(self, num_running_seqs: _Optional[int] = ..., num_reserved: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., num_total_kv_blocks: _Optional[int] = ..., num_free_state_slots: _Optional[int] = ..., num_total_state_slots: _Optional[int] = ...) -> None: ...
