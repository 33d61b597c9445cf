"""What can go wrong with stored state, as exceptions that survive the trip over gRPC.

Each class names the gRPC status it travels as (`grpc_code`, a `grpc.StatusCode` name, so this
module stays grpc-free); the servicer sends the class name along and the client raises the same
class again, so callers handle one set of errors whether the store is local or remote.
"""

from __future__ import annotations


class StateStoreError(Exception):
    """Base of every state-store error."""

    grpc_code = "INTERNAL"


class StateUnavailableError(StateStoreError):
    """The state asked for cannot be read: never stored, or gone (see the subclasses)."""

    grpc_code = "NOT_FOUND"


class StateNotFoundError(StateUnavailableError):
    """No key of that name was ever stored here (or it was forgotten long ago)."""


class LeaseExpiredError(StateUnavailableError):
    """The key's lease ran out before anyone released it, so the store freed it."""


class StateEvictedError(StateUnavailableError):
    """The store ran out of room and dropped the key (a partial state is never kept)."""


class StateReleasedError(StateUnavailableError):
    """The key was released (by key or by owner) or the store closed."""


class CorruptStateError(StateStoreError):
    """Bytes did not match their checksum; the bad bytes were never handed out."""

    grpc_code = "DATA_LOSS"


class OwnershipError(StateStoreError):
    """A write named a different owner than the one that created the key."""

    grpc_code = "PERMISSION_DENIED"


class KeySealedError(StateStoreError):
    """A write arrived for a key that was already sealed, or repeated a stored chunk."""

    grpc_code = "ALREADY_EXISTS"


class StoreFullError(StateStoreError):
    """Neither tier could make room for a chunk (too large, or the rest is pinned)."""

    grpc_code = "RESOURCE_EXHAUSTED"


class TierFullError(StoreFullError):
    """One tier could not make room; the store then tries the next tier."""


class StateTimeoutError(StateStoreError):
    """A read waited longer than its timeout for the writer to finish the key."""

    grpc_code = "DEADLINE_EXCEEDED"


class InvalidChunkError(StateStoreError, ValueError):
    """A chunk's metadata is inconsistent (size vs shape and dtype, indices, token range)."""

    grpc_code = "INVALID_ARGUMENT"


ERRORS_BY_NAME: dict[str, type[StateStoreError]] = {
    cls.__name__: cls
    for cls in (
        StateStoreError,
        StateUnavailableError,
        StateNotFoundError,
        LeaseExpiredError,
        StateEvictedError,
        StateReleasedError,
        CorruptStateError,
        OwnershipError,
        KeySealedError,
        StoreFullError,
        TierFullError,
        StateTimeoutError,
        InvalidChunkError,
    )
}
