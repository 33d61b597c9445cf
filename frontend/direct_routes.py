"""The generation routes served straight from the request, past FastAPI's routing and handler.

A completions or chat request whose body is well-formed JSON that validates, sent as
`application/json`, is what nearly all traffic is; for it FastAPI's routing, exit stacks, body
handling and dependency solving cost more CPU than everything the route itself does but the
worker call and the tokenizer. `DirectRoutes` does for such a request exactly what FastAPI would:
the body parsed with `json.loads` and validated as the route's model as FastAPI validates it
(`from_attributes`), the API key checked, the route's function called with the body, the request
and the pipeline, a `GatewayError` from it answered by the app's own handler. Anything else (another
content type, malformed JSON, a body that does not validate, an empty one) it leaves to FastAPI,
which answers it as it always has: one source of every error a client can see.

`DirectRoute.of` checks that a route's function takes exactly what is handed to it (the body model,
the `Request`, `PipelineDep`), so a route that grows a parameter fails at startup, not silently.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from frontend.generate import Pipeline
from frontend.routes.state import PipelineDep

Endpoint = Callable[[Any, Request, Pipeline], Awaitable[Response]]


@dataclass(frozen=True)
class DirectRoute:
    """One POST route: its body model and its function (body, request, pipeline) -> Response."""

    model: type[BaseModel]
    endpoint: Endpoint

    @classmethod
    def of(cls, endpoint: Callable[..., Awaitable[Response]]) -> DirectRoute:
        """The route of `endpoint`, checked to take (body: a model, raw: Request, pipeline: PipelineDep)."""
        hints = typing.get_type_hints(endpoint, include_extras=True)
        names = list(inspect.signature(endpoint).parameters)
        model = hints.get(names[0]) if names else None
        shape_ok = (
            len(names) == 3
            and isinstance(model, type)
            and issubclass(model, BaseModel)
            and hints.get(names[1]) is Request
            and hints.get(names[2]) == PipelineDep
        )
        if not shape_ok or model is None:
            raise TypeError(
                f"{endpoint.__qualname__} cannot be served directly: it must take (body: <model>, "
                "raw: Request, pipeline: PipelineDep); serve it through FastAPI alone or extend DirectRoutes"
            )
        return cls(model, endpoint)


class DirectRoutes:
    """Owns the direct serving of `routes` (path -> DirectRoute) behind `check_key` (the API key
    dependency every OpenAI route has)."""

    def __init__(
        self, routes: dict[str, DirectRoute], check_key: Callable[[Request], Awaitable[None]]
    ) -> None:
        self.routes = routes
        self.check_key = check_key

    async def serve(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> bool:
        """Answer the request, whose whole `body` was read, and say True; or do nothing and say
        False: FastAPI is to answer it. `receive` gives what follows the body (a disconnect)."""
        route = self.routes.get(scope["path"])
        if route is None or scope["method"] != "POST" or scope.get("root_path") or not body:
            return False
        if not _declares_json(scope):
            return False
        try:
            value = route.model.model_validate(json.loads(body), from_attributes=True)
        except Exception:  # noqa: BLE001 - FastAPI parses it again and answers with the error
            return False
        request = Request(scope, receive)
        app = scope["app"]
        try:
            await self.check_key(request)
            response = await route.endpoint(value, request, app.state.pipeline)
        except Exception as exc:
            handler = _handler_for(app.exception_handlers, exc)
            if handler is None:
                raise  # as through FastAPI: the server error middleware's 500
            response = await handler(request, exc)
        await response(scope, receive, send)
        return True


def _declares_json(scope: Scope) -> bool:
    """`Content-Type: application/json` (parameters aside): a type FastAPI parses as JSON."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def _handler_for(handlers: dict[Any, Any], exc: Exception) -> Any:
    """The app's handler of `exc` as Starlette's exception middleware finds it (the closest class),
    leaving `Exception` to the server error middleware as Starlette does."""
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in handlers:
            return handlers[cls]
    return None
