"""The request body size limit: a 413 before the body is parsed, or even read past the limit.

A declared `Content-Length` over the limit is refused before a byte of the body is read; a
body without one (chunked) is read up to the limit and refused as soon as it passes it. What
is under the limit goes to the app unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.errors import ErrorJSONResponse, error_body, refusal_reason


class BodyLimit:
    """ASGI middleware: owns the check of every HTTP request body against `max_request_bytes`,
    and tells `on_refusal` of each request it refuses."""

    def __init__(
        self, app: ASGIApp, max_request_bytes: int, on_refusal: Callable[[str], None] = lambda reason: None
    ) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.max_request_bytes:
                await self._refuse(scope, receive, send, f"declares {declared} bytes")
                return
            await self.app(scope, receive, send)  # the server delivers no more than declared
            return
        body = bytearray()
        first: list[Message] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                first.append(message)
                break
            body.extend(message.get("body", b""))
            if len(body) > self.max_request_bytes:
                await self._refuse(scope, receive, send, f"passed {self.max_request_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        first.insert(0, {"type": "http.request", "body": bytes(body), "more_body": False})

        async def replay() -> Message:
            return first.pop(0) if first else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        self.on_refusal(refusal_reason(413, None))
        message = (
            f"the request body {what}; this gateway takes at most {self.max_request_bytes} bytes "
            "(gateway.max_request_bytes): send a shorter prompt"
        )
        # Connection: close: the unread rest of the body must not be read as the next request.
        response = ErrorJSONResponse(
            error_body(413, message), status_code=413, headers={"connection": "close"}
        )
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length itself
    return None
