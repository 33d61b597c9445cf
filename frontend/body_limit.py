"""The request body size limit: a 413 before the body is parsed, or even read past the limit.

A declared `Content-Length` over the limit is refused before a byte of the body is read; a
body without one (chunked) is read up to the limit and refused as soon as it passes it. What
is under the limit goes to the app unchanged. `frontend.front_door` applies it to every request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import Message, Receive, Scope, Send

from frontend.errors import ErrorJSONResponse, error_body, refusal_reason


@dataclass
class ReadBody:
    """A body read whole (or as far as the client sent it): its bytes, and the messages to replay
    to an app that reads it again (the body, then a disconnect if the client left meanwhile)."""

    body: bytes
    complete: bool  # False: the client left before the body's end
    messages: list[Message]

    def replay(self, receive: Receive) -> Receive:
        """A `receive` that gives the messages read here, then the server's."""
        messages = list(self.messages)

        async def replayed() -> Message:
            return messages.pop(0) if messages else await receive()

        return replayed


class BodyLimit:
    """Owns the check of HTTP request bodies against `max_request_bytes`, and tells `on_refusal`
    of each request it refuses."""

    def __init__(
        self, max_request_bytes: int, on_refusal: Callable[[str], None] = lambda reason: None
    ) -> None:
        self.max_request_bytes = max_request_bytes
        self.on_refusal = on_refusal

    async def read(self, receive: Receive) -> ReadBody | None:
        """The whole body, read up to the limit; None once it passes it (then `refuse`)."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                head = {"type": "http.request", "body": bytes(body), "more_body": False}
                return ReadBody(bytes(body), False, [head, message])
            body.extend(message.get("body", b""))
            if len(body) > self.max_request_bytes:
                return None
            if not message.get("more_body", False):
                whole = bytes(body)
                return ReadBody(whole, True, [{"type": "http.request", "body": whole, "more_body": False}])

    async def refuse(self, scope: Scope, receive: Receive, send: Send, what: str | None = None) -> None:
        """The 413 for a body that `what` (by default: passed the limit)."""
        self.on_refusal(refusal_reason(413, None))
        what = what or f"passed {self.max_request_bytes} bytes"
        message = (
            f"the request body {what}; this gateway takes at most {self.max_request_bytes} bytes "
            "(gateway.max_request_bytes): send a shorter prompt"
        )
        # Connection: close: the unread rest of the body must not be read as the next request.
        response = ErrorJSONResponse(
            error_body(413, message), status_code=413, headers={"connection": "close"}
        )
        await response(scope, receive, send)


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length itself
    return None
