from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class StateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_KIND_UNSPECIFIED: _ClassVar[StateKind]
    STATE_KIND_MLA_KV: _ClassVar[StateKind]
    STATE_KIND_KDA_CONV: _ClassVar[StateKind]
    STATE_KIND_KDA_RECURRENT: _ClassVar[StateKind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
STATE_KIND_UNSPECIFIED: StateKind
STATE_KIND_MLA_KV: StateKind
STATE_KIND_KDA_CONV: StateKind
STATE_KIND_KDA_RECURRENT: StateKind

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens", "include_stop_str_in_output", "best_of")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    best_of: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., best_of: _Optional[int] = ...) -> None: ...

class SampleStart(_message.Message):
    __slots__ = ("token_id", "logprobs", "finish_reason", "stop_token_id")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprobs: TokenLogprobs
    finish_reason: FinishReason
    stop_token_id: int
    def __init__(self, token_id: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("key", "layer", "kind", "dtype", "shape", "token_start", "token_end", "checksum", "data", "chunk_index", "num_chunks", "owner", "lease_s", "final", "region", "region_offset", "head_start", "head_end", "num_heads")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    key: str
    layer: int
    kind: StateKind
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    token_start: int
    token_end: int
    checksum: int
    data: bytes
    chunk_index: int
    num_chunks: int
    owner: str
    lease_s: float
    final: bool
    region: str
    region_offset: int
    head_start: int
    head_end: int
    num_heads: int
    def __init__(self, key: _Optional[str] = ..., layer: _Optional[int] = ..., kind: _Optional[_Union[StateKind, str]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., checksum: _Optional[int] = ..., data: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., owner: _Optional[str] = ..., lease_s: _Optional[float] = ..., final: _Optional[bool] = ..., region: _Optional[str] = ..., region_offset: _Optional[int] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ..., num_heads: _Optional[int] = ...) -> None: ...

class StateHandle(_message.Message):
    __slots__ = ("store_address", "key", "owner", "num_layers", "lease_expiry_unix_s")
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    store_address: str
    key: str
    owner: str
    num_layers: int
    lease_expiry_unix_s: float
    def __init__(self, store_address: _Optional[str] = ..., key: _Optional[str] = ..., owner: _Optional[str] = ..., num_layers: _Optional[int] = ..., lease_expiry_unix_s: _Optional[float] = ...) -> None: ...
