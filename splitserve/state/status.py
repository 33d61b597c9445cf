"""State errors <-> gRPC status: how a store error leaves a servicer and comes back as itself.

The servicer ends an RPC with the error's `grpc_code` and its class name in trailing metadata
(`abort_with_error`); the client turns the failed call back into that class (`error_from_rpc`),
so callers handle one set of errors whether the store is local or remote.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from splitserve import rpc
from splitserve.state.errors import (
    ERRORS_BY_NAME,
    StateStoreError,
    StateTimeoutError,
    StateUnavailableError,
)

ERROR_TYPE_KEY = "splitserve-error-type"  # trailing metadata: the exception class, for the client
_BY_CODE: dict[grpc.StatusCode, type[StateStoreError]] = {
    grpc.StatusCode.UNAVAILABLE: StateUnavailableError,  # the store could not be reached
    grpc.StatusCode.DEADLINE_EXCEEDED: StateTimeoutError,
}


def status_code(error: Exception) -> grpc.StatusCode:
    """The status `error` travels as: its class's `grpc_code`, INVALID_ARGUMENT for other errors."""
    return getattr(grpc.StatusCode, getattr(error, "grpc_code", "INVALID_ARGUMENT"))


def abort_with_error(context: grpc.ServicerContext, error: Exception) -> NoReturn:
    """Ends the RPC with `error`'s status code, its message, and its class name for the client."""
    context.set_trailing_metadata(((ERROR_TYPE_KEY, type(error).__name__),))
    rpc.abort(context, status_code(error), str(error))


async def abort_with_error_async(context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:
    """`abort_with_error` for a grpc.aio servicer."""
    context.set_trailing_metadata(((ERROR_TYPE_KEY, type(error).__name__),))
    await context.abort(status_code(error), str(error))
    raise AssertionError("grpc.aio's abort returned")  # it raises; this keeps NoReturn honest


def error_from_rpc(error: grpc.RpcError) -> Exception:
    """The store exception a failed RPC stands for (the server names its class); else one chosen
    by status code that keeps the code, so a caller passing it on reports the same status."""
    trailing = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    name = trailing.get(ERROR_TYPE_KEY)
    details = error.details()  # type: ignore[attr-defined]
    if name == "ValueError":
        return ValueError(details)
    if name in ERRORS_BY_NAME:
        return ERRORS_BY_NAME[name](details)
    code = error.code()  # type: ignore[attr-defined]
    translated = _BY_CODE.get(code, StateStoreError)(f"state store RPC failed: {code.name}: {details}")
    translated.grpc_code = code.name  # type: ignore[misc]
    return translated
