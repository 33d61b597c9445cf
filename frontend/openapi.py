"""The OpenAPI document at /openapi.json, made to say what the server sends.

FastAPI declares a 422 for every route with a body (this gateway answers 400 in its own error
shape) and nothing else a route may send. Routes declare their own responses with
`error_responses` and `generation_responses`; `install_openapi` drops FastAPI's 422 and its
validation-error schemas and adds what every route may send: a 500 (a bug, in the error shape)
and, for a route with a body, the 413 of `frontend.body_limit`; and fills in the limits of what the
gateway serves (`frontend.schema_bounds`). A test runs schemathesis against
the document to hold server and document together.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from frontend.errors import ErrorResponse
from frontend.schema_bounds import Bounds

_DESCRIPTIONS = {
    400: "The request is invalid: malformed JSON, a wrong type, a value out of range, a refused field, "
    "a prompt too long for the context or the character limit",
    401: "API keys are configured and the request carries none of them",
    404: "`model` names a model this server does not serve",
    413: "The request body is over `gateway.max_request_bytes`",
    429: "Every decode worker is full and the admission queue too: retry after `Retry-After` seconds",
    500: "A bug in the gateway; the message gives an error id to find in its log",
    503: "No worker can take the request (none known, unreachable, failing or timed out), or the "
    "gateway is draining",
}
_RETRY_AFTER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entries of error statuses a route sends, each with the error schema."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _DESCRIPTIONS[status]}
        if status == 429:
            entry["headers"] = _RETRY_AFTER
        out[status] = entry
    return out


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A generation route's responses: the whole `model` as JSON, or a server-sent event stream."""
    # One server-sent event: what schemathesis (and OpenAPI 3.2's itemSchema) validate per event.
    event = {
        "type": "object",
        "properties": {
            "data": {
                "type": "string",
                "description": "a chunk (the 200's JSON shape) as JSON; a failure after the first "
                'chunk is one last `{"error": ...}` event; the stream ends with `[DONE]`',
            },
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
        "required": ["data"],
    }
    stream = {"schema": event}
    ok = {
        "model": model,
        "description": "The whole response; with `stream: true`, server-sent events",
        "content": {"text/event-stream": stream},
    }
    return {200: ok, **error_responses(400, 401, 404, 429, 503)}


def install_openapi(app: FastAPI, bounds: Bounds | None = None) -> None:
    """Serve the corrected document (built once, on the first request for it), with the limits
    of what this gateway serves (`bounds`; None: the markers of those limits are only dropped)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = corrected_schema(
                get_openapi(title=app.title, version=app.version, routes=app.routes), bounds
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def corrected_schema(schema: dict[str, Any], bounds: Bounds | None = None) -> dict[str, Any]:
    """FastAPI's document without its 422s, with the 413 and 500 every route may send, and the
    gateway's own limits filled in (whole-number limits written as integers)."""
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    error_content = {"application/json": {"schema": error_ref}}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            extra = [413, 500] if "requestBody" in operation else [500]
            for status in extra:
                responses.setdefault(
                    str(status), {"description": _DESCRIPTIONS[status], "content": error_content}
                )
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if "ErrorResponse" not in schemas:  # every route's 500 refers to it
        full = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(full.pop("$defs", {}))
        schemas["ErrorResponse"] = full
    (bounds or Bounds()).fill(schema)
    return schema
