from splitserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "store_address", "state_key", "state_owner", "lease_s", "prefix_hashes", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    store_address: str
    state_key: str
    state_owner: str
    lease_s: float
    prefix_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., store_address: _Optional[str] = ..., state_key: _Optional[str] = ..., state_owner: _Optional[str] = ..., lease_s: _Optional[float] = ..., prefix_hashes: _Optional[_Iterable[bytes]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillTiming(_message.Message):
    __slots__ = ("arrival_unix_s", "queue_s", "prefill_s", "state_put_s", "state_bytes", "state_stream_s")
    ARRIVAL_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    STATE_PUT_S_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_STREAM_S_FIELD_NUMBER: _ClassVar[int]
    arrival_unix_s: float
    queue_s: float
    prefill_s: float
    state_put_s: float
    state_bytes: int
    state_stream_s: float
    def __init__(self, arrival_unix_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., state_put_s: _Optional[float] = ..., state_bytes: _Optional[int] = ..., state_stream_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprobs", "finish_reason", "stop_token_id", "state", "num_prompt_tokens", "num_cached_tokens", "timing", "samples")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    state: _common_pb2.StateHandle
    num_prompt_tokens: int
    num_cached_tokens: int
    timing: PrefillTiming
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.SampleStart]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.StateHandle, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., timing: _Optional[_Union[PrefillTiming, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[_common_pb2.SampleStart, _Mapping]]] = ...) -> None: ...

class CacheReportRequest(_message.Message):
    __slots__ = ("instance_id", "after_seq")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    after_seq: int
    def __init__(self, instance_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class PrefixEvent(_message.Message):
    __slots__ = ("stored", "block_hash", "num_tokens")
    STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    block_hash: bytes
    num_tokens: int
    def __init__(self, stored: _Optional[bool] = ..., block_hash: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PrefixCacheReport(_message.Message):
    __slots__ = ("instance_id", "events", "num_queried_tokens", "num_hit_tokens", "num_imported_tokens", "num_lost_to_missing_state_tokens", "num_snapshots", "snapshot_bytes", "num_evictions", "last_seq", "snapshot")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOST_TO_MISSING_STATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    events: _containers.RepeatedCompositeFieldContainer[PrefixEvent]
    num_queried_tokens: int
    num_hit_tokens: int
    num_imported_tokens: int
    num_lost_to_missing_state_tokens: int
    num_snapshots: int
    snapshot_bytes: int
    num_evictions: int
    last_seq: int
    snapshot: bool
    def __init__(self, instance_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[PrefixEvent, _Mapping]]] = ..., num_queried_tokens: _Optional[int] = ..., num_hit_tokens: _Optional[int] = ..., num_imported_tokens: _Optional[int] = ..., num_lost_to_missing_state_tokens: _Optional[int] = ..., num_snapshots: _Optional[int] = ..., snapshot_bytes: _Optional[int] = ..., num_evictions: _Optional[int] = ..., last_seq: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class AbortPrefillRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortPrefillResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
