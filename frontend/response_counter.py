"""Counting every HTTP response by route and status, streams and middleware answers included."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.metrics import GatewayMetrics

# Routes counted by name; anything else counts as "other", so a scanner cannot grow the series.
ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


class CountResponses:
    """ASGI middleware counting responses by route and status; outermost, so it also counts the
    draining 503s and the 500 of an exception that escaped everything else."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.observe_response(route, int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            self.metrics.observe_response(route, 500)
            raise
