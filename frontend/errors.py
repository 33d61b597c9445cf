"""OpenAI-shaped errors and the FastAPI handlers that make every failure one of them.

Every error body is `{"error": {"message", "type", "param", "code"}}` (`ErrorResponse`, also
what the OpenAPI document declares); nothing leaves the gateway as a bare 500 or as FastAPI's
own `{"detail": ...}` shape. Bodies are written as ASCII JSON, so no text a request carried
(a lone surrogate, say) can break the rendering of its own error.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what every 429 tells the client to wait before retrying

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


# Refusal reasons for the statuses whose errors carry no string code (the metric's label values).
_REASONS = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The body of every error the gateway sends (OpenAI's shape)."""

    error: ErrorDetail


class ErrorJSONResponse(JSONResponse):
    """JSON written as ASCII: text from a request (a lone surrogate, say) cannot fail to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class GatewayError(Exception):
    """A failure with the HTTP status and OpenAI error fields the client should see."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | int | None]]:
        return error_body(self.status_code, self.message, self.param, self.code)


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | int | None]]:
    error_type = _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code or status_code}}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param)


def unauthorized(
    message: str = "missing or invalid API key; send 'Authorization: Bearer <key>'",
) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")


def model_not_found(model: str, served: str) -> GatewayError:
    return GatewayError(
        404, f"the model '{model}' does not exist; this server serves '{served}'", "model", "model_not_found"
    )


def over_capacity(message: str) -> GatewayError:
    return GatewayError(429, message, code="over_capacity")


def unavailable(message: str) -> GatewayError:
    return GatewayError(503, message, code="service_unavailable")


def refusal_reason(status_code: int, code: str | int | None) -> str:
    """The label a refused request is counted under: its error code, else one per status."""
    if isinstance(code, str):
        return code
    return _REASONS.get(status_code, f"http_{status_code}")


def install_error_handlers(app: FastAPI, on_refusal: Callable[[str], None] = lambda reason: None) -> None:
    """Map gateway errors, request validation, unknown routes and crashes to OpenAI JSON.

    `on_refusal(reason)` is told of every error answered here but a crash's 500 (the metric of
    refusals: work the gateway turned away, counted apart from the work it did)."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        on_refusal(refusal_reason(exc.status_code, exc.code))
        # A 429 always says when to come back (RFC 9110 Retry-After, in seconds).
        headers = {"retry-after": str(RETRY_AFTER_S)} if exc.status_code == 429 else None
        return ErrorJSONResponse(exc.body(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        on_refusal(refusal_reason(400, None))
        return ErrorJSONResponse(validation_error(exc).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        on_refusal(refusal_reason(exc.status_code, None))
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's words
            detail = (
                "the request body could not be parsed as JSON: invalid UTF-8, nesting too deep, or a "
                "number too long"
            )
        body = error_body(exc.status_code, detail)
        # exc.headers carries what the status needs: `Allow` on a 405 (RFC 9110)
        return ErrorJSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # The exception's text stays in the log: it may hold paths, addresses or internals.
        error_id = uuid.uuid4().hex[:12]
        logger.exception("unexpected error %s in the gateway", error_id)
        message = f"internal error in the gateway; its log has the cause under error id {error_id}"
        return ErrorJSONResponse(error_body(500, message), status_code=500)


def validation_error(exc: RequestValidationError) -> GatewayError:
    """One 400 naming the first bad field (`messages.0.content`) and what was wrong with it."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":  # loc is ("body", character offset), not a field
        reason = (first.get("ctx") or {}).get("error", "malformed JSON")
        offset = first.get("loc", ("body", "?"))[-1]
        return bad_request(f"the request body is not valid JSON: {reason} (at character {offset})")
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "model_attributes_type":
        # not an object: a JSON array or string, or a body FastAPI did not read as JSON at all
        return bad_request(
            "the request body must be a JSON object, sent with 'Content-Type: application/json'"
        )
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    param = ".".join(location) or None
    message = str(first.get("msg", "invalid value"))
    if isinstance(first.get("ctx"), dict) and isinstance(first["ctx"].get("error"), ValueError):
        message = str(first["ctx"]["error"])
    return bad_request(f"{param}: {message}" if param else message, param)


def _is_type_tag(part: object) -> bool:
    """pydantic names the union member that failed in the location (`stop.str`); drop it."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part)
