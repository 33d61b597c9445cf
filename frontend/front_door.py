"""The gateway's one ASGI middleware: what every request passes before a route.

In order, for each HTTP request:

* every response is counted by route and status (`splitserve_http_responses_total`), streams
  and the answers given here included, and the 500 of an exception that escaped everything else;
* a generation request (completions, chat) is admitted through `Admission` (a 503 once the
  gateway drains) and counted until its last byte is out;
* the body is held to `gateway.max_request_bytes` (`frontend.body_limit`: a 413);
* a generation request's body is read here whole and, when well-formed, served by
  `frontend.direct_routes` straight from it; anything else goes on to FastAPI.

One layer instead of one per concern: each layer of an ASGI stack costs a coroutine frame on
every resumption of the request's task and a wrapper on every message it sends.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.admission import DRAINING, GENERATION_ROUTES, Admission
from frontend.body_limit import BodyLimit, ReadBody, content_length
from frontend.direct_routes import DirectRoutes
from frontend.metrics import GatewayMetrics

# Routes counted by name; anything else counts as "other", so a scanner cannot grow the series.
COUNTED_ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


class FrontDoor:
    """ASGI middleware owning, for every HTTP request, the response count, the admission of
    generation requests, the body limit and the choice between the direct routes and FastAPI."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: GatewayMetrics,
        admission: Admission,
        body_limit: BodyLimit,
        direct: DirectRoutes | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.admission = admission
        self.body_limit = body_limit
        self.direct = direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in COUNTED_ROUTES else "other"
        observe = self.metrics.observe_response

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                observe(route, int(message["status"]))
            await send(message)

        try:
            if path not in GENERATION_ROUTES:
                await self._bounded(scope, receive, counting_send)
            elif not self.admission.try_admit():
                await DRAINING(scope, receive, counting_send)
            else:
                try:
                    await self._generation(scope, receive, counting_send)
                finally:
                    self.admission.release()
        except Exception:
            observe(route, 500)
            raise

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request on to FastAPI, its body held to the limit."""
        if not await self._within_declared_limit(scope, receive, send):
            return
        if content_length(scope) is not None:
            await self.app(scope, receive, send)  # the server delivers no more than declared
            return
        read = await self._read(scope, receive, send)
        if read is not None:
            await self.app(scope, read.replay(receive), send)

    async def _generation(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A generation request: its body read whole (within the limit), then served directly
        when it can be, else by FastAPI from the body read here."""
        if not await self._within_declared_limit(scope, receive, send):
            return
        read = await self._read(scope, receive, send)
        if read is None:
            return
        if (
            read.complete
            and self.direct is not None
            and await self.direct.serve(scope, read.body, receive, send)
        ):
            return
        await self.app(scope, read.replay(receive), send)

    async def _within_declared_limit(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """False after the 413 for a body that declares more than the limit (nothing read)."""
        declared = content_length(scope)
        if declared is not None and declared > self.body_limit.max_request_bytes:
            await self.body_limit.refuse(scope, receive, send, f"declares {declared} bytes")
            return False
        return True

    async def _read(self, scope: Scope, receive: Receive, send: Send) -> ReadBody | None:
        """The body read whole within the limit; None after the 413 for one that passes it."""
        read = await self.body_limit.read(receive)
        if read is None:
            await self.body_limit.refuse(scope, receive, send)
        return read
