from splitserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[_common_pb2.StateChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[_common_pb2.StateChunk, _Mapping]]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_chunks", "num_bytes")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    num_bytes: int
    def __init__(self, num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "layers", "timeout_s", "wait_for_key", "regions")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_KEY_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    key: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    wait_for_key: bool
    regions: bool
    def __init__(self, key: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ..., wait_for_key: _Optional[bool] = ..., regions: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("key", "prefix", "token_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    prefix: PrefixHashes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[str] = ..., prefix: _Optional[_Union[PrefixHashes, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixHashes(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("found", "key", "num_units", "owner", "sealed", "num_bytes", "num_layers", "lease_expiry_unix_s", "chunks", "num_tokens")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_UNITS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    key: str
    num_units: int
    owner: str
    sealed: bool
    num_bytes: int
    num_layers: int
    lease_expiry_unix_s: float
    chunks: _containers.RepeatedCompositeFieldContainer[_common_pb2.StateChunk]
    num_tokens: int
    def __init__(self, found: _Optional[bool] = ..., key: _Optional[str] = ..., num_units: _Optional[int] = ..., owner: _Optional[str] = ..., sealed: _Optional[bool] = ..., num_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., lease_expiry_unix_s: _Optional[float] = ..., chunks: _Optional[_Iterable[_Union[_common_pb2.StateChunk, _Mapping]]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("key", "prefix", "tail_token_ids", "num_tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    TAIL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: str
    prefix: PrefixHashes
    tail_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, key: _Optional[str] = ..., prefix: _Optional[_Union[PrefixHashes, _Mapping]] = ..., tail_token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("key", "lease_s", "owner")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    key: str
    lease_s: float
    owner: str
    def __init__(self, key: _Optional[str] = ..., lease_s: _Optional[float] = ..., owner: _Optional[str] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("lease_expiry_unix_s",)
    LEASE_EXPIRY_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    lease_expiry_unix_s: float
    def __init__(self, lease_expiry_unix_s: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("key", "owner")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    key: str
    owner: str
    def __init__(self, key: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_keys", "num_bytes")
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_keys: int
    num_bytes: int
    def __init__(self, num_keys: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "num_bytes", "capacity_bytes", "num_objects", "num_pinned", "num_keys")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_bytes: int
    capacity_bytes: int
    num_objects: int
    num_pinned: int
    num_keys: int
    def __init__(self, name: _Optional[str] = ..., num_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., num_objects: _Optional[int] = ..., num_pinned: _Optional[int] = ..., num_keys: _Optional[int] = ...) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("tiers", "num_keys", "num_hits", "num_misses", "num_prefix_hits", "num_spills", "num_evictions", "num_expiries", "num_releases", "num_corruptions", "num_prefix_lookups", "num_prefix_hit_tokens", "num_prefix_evictions", "num_prefix_keys", "num_prefix_bytes")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPILLS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_RELEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    num_keys: int
    num_hits: int
    num_misses: int
    num_prefix_hits: int
    num_spills: int
    num_evictions: int
    num_expiries: int
    num_releases: int
    num_corruptions: int
    num_prefix_lookups: int
    num_prefix_hit_tokens: int
    num_prefix_evictions: int
    num_prefix_keys: int
    num_prefix_bytes: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., num_keys: _Optional[int] = ..., num_hits: _Optional[int] = ..., num_misses: _Optional[int] = ..., num_prefix_hits: _Optional[int] = ..., num_spills: _Optional[int] = ..., num_evictions: _Optional[int] = ..., num_expiries: _Optional[int] = ..., num_releases: _Optional[int] = ..., num_corruptions: _Optional[int] = ..., num_prefix_lookups: _Optional[int] = ..., num_prefix_hit_tokens: _Optional[int] = ..., num_prefix_evictions: _Optional[int] = ..., num_prefix_keys: _Optional[int] = ..., num_prefix_bytes: _Optional[int] = ...) -> None: ...

class ArenaRequest(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, regions: _Optional[_Iterable[str]] = ...) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("directory", "probe_name", "probe_token", "transfer_engine", "transfer_endpoint", "region_addresses")
    class RegionAddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    PROBE_NAME_FIELD_NUMBER: _ClassVar[int]
    PROBE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REGION_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    directory: str
    probe_name: str
    probe_token: bytes
    transfer_engine: str
    transfer_endpoint: str
    region_addresses: _containers.ScalarMap[str, int]
    def __init__(self, directory: _Optional[str] = ..., probe_name: _Optional[str] = ..., probe_token: _Optional[bytes] = ..., transfer_engine: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., region_addresses: _Optional[_Mapping[str, int]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("key", "owner", "lease_s", "layer", "kind", "num_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    owner: str
    lease_s: float
    layer: int
    kind: _common_pb2.StateKind
    num_bytes: int
    def __init__(self, key: _Optional[str] = ..., owner: _Optional[str] = ..., lease_s: _Optional[float] = ..., layer: _Optional[int] = ..., kind: _Optional[_Union[_common_pb2.StateKind, str]] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: str
    def __init__(self, region: _Optional[str] = ...) -> None: ...
