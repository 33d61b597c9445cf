"""The cluster's shared token on every internal gRPC call: one interceptor on each side.

A deployment's controller makes one random token (`new_cluster_token`) and hands it to every
actor it starts (through Ray, never a command line or an environment variable); each process
holds it with `set_cluster_token`. From then on the servers and channels `splitserve.rpc` makes
in that process carry it: every client call sends it as call metadata, every server refuses a
call without it (UNAUTHENTICATED) at call start, from the call's metadata: before any servicer
runs and before its request message is read. The gRPC health service stays open, so probes that
cannot hold a token (a load balancer, a kubelet) can still ask for liveness; a caller without the
token is answered as if its request were empty (the server's own status, whichever `service` it
names), its request unread too. A caller with the token gets the full health protocol.

Why "before it is read" needs care: a grpc-python server (threaded or grpc.aio) reads a
unary-request method's whole message, up to the server's message limit, before the handler's
behaviour runs, so a refusal as a unary handler still let a caller without the token park 64 MiB
per call in the server (16 concurrent 58 MB calls took the store from 120 MB to 1.4 GB). A
request-streaming handler reads nothing until its behaviour asks for a message; the refusal (and
the open answer) is one, and never asks. A refused call's bytes then stop at the server's
lookahead (`splitserve.rpc.SERVER_LOOKAHEAD_BYTES`): measured, 16 refused 58 MB calls put 10-14
MB on the wire and +2-3 MiB on the server's peak RSS (docs/PERFORMANCE.md, section 15).

The token is a secret: never log it, nor put it in an error message. A process that holds no
token (offline tests, a single engine) makes open servers and plain channels, as before.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

TOKEN_METADATA_KEY = "x-splitserve-cluster-token"  # gRPC metadata keys are lowercase ASCII
OPEN_SERVICE_PREFIX = "/grpc.health.v1.Health/"
REFUSAL = (
    "this splitserve service accepts only calls from its own deployment (the cluster token in call "
    f"metadata {TOKEN_METADATA_KEY!r} is missing or wrong); call it through the cluster's gateway"
)

_token: str | None = None


def new_cluster_token() -> str:
    """A fresh random token for one deployment (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def set_cluster_token(token: str | None) -> None:
    """Hold `token` in this process: servers and channels made from now on require and send it."""
    global _token
    _token = token or None


def cluster_token() -> str | None:
    return _token


def _holds_token(metadata: Any, token: str) -> bool:
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            sent = value.encode() if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(sent, token.encode())
    return False


def _unread(handler: grpc.RpcMethodHandler, behaviour: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """`behaviour` in place of `handler`'s, as a handler that reads no request until `behaviour`
    iterates its requests: always request-streaming (whatever `handler`'s kind; the client cannot
    tell), so the server asks the transport for no message before. The response kind and
    serializer follow `handler`'s."""
    kind = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    return kind(behaviour, response_serializer=handler.response_serializer)


def _empty_request(handler: grpc.RpcMethodHandler) -> Any:
    """The request message with every field at its default (the empty message's bytes)."""
    return handler.request_deserializer(b"") if handler.request_deserializer else b""


def _unread_answer(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """An open unary-request method for a caller without the token: answered as if its request
    were empty, without reading it (for health, the server's own status, whichever `service`
    the request names). Request-streaming methods pass as they are (health has none)."""
    if handler.request_streaming:
        return handler
    behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary

    def answer(_requests: Any, context: grpc.ServicerContext) -> Any:
        return behaviour(_empty_request(handler), context)  # never iterates `_requests`

    return _unread(handler, answer)


def _aio_unread_answer(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`_unread_answer` for grpc.aio, whose health servicer's methods are coroutines (`Watch`
    writes its responses through the context)."""
    if handler.request_streaming:
        return handler
    behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary

    async def answer(_requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(_empty_request(handler), context)  # never iterates `_requests`

    return _unread(handler, answer)


def _refuse(_requests: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)  # never iterates `_requests`


async def _aio_refuse(_requests: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)  # never iterates `_requests`


class TokenCheck(grpc.ServerInterceptor):
    """Server side (threaded servers): calls without the token are refused at call start, from
    their metadata, before any servicer runs or their request is read."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or _holds_token(details.invocation_metadata, self._token):
            return handler
        if details.method.startswith(OPEN_SERVICE_PREFIX):
            return _unread_answer(handler)
        return _unread(handler, _refuse)


class AioTokenCheck(grpc.aio.ServerInterceptor):
    """Server side (grpc.aio servers, e.g. the state store): the same check, also unread."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or _holds_token(details.invocation_metadata, self._token):
            return handler
        if details.method.startswith(OPEN_SERVICE_PREFIX):
            return _aio_unread_answer(handler)
        return _unread(handler, _aio_refuse)


class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def _with_token(metadata: Any, token: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (TOKEN_METADATA_KEY, token)]


class TokenSender(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Client side (threaded channels): every call carries the token as metadata."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _Details(details, _with_token(details.metadata, self._token))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


class _AioTokenDetails:
    """What the four grpc.aio client interceptors share: the call details plus the token."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*_with_token(details.metadata, self._token)),
            details.credentials,
            details.wait_for_ready,
        )


class _AioUnaryUnary(_AioTokenDetails, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioTokenDetails, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioTokenDetails, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioTokenDetails, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def aio_token_senders(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client side (grpc.aio channels, e.g. the gateway's): every call carries the token. One
    interceptor per call kind: a grpc.aio channel files each interceptor under its first kind only."""
    return [cls(token) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]
