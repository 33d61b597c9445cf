"""The direct routes (frontend/direct_routes.py) answer as FastAPI does, and leave it the rest."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi import Request, Response

from frontend.direct_routes import DirectRoute, DirectRoutes
from frontend.protocol import CompletionRequest
from tests.frontend.conftest import MODEL, running_gateway

# (path, body as sent, content type, whether the direct route serves it)
REQUESTS: list[tuple[str, bytes, str, bool]] = [
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3}).encode(),
        "application/json",
        True,
    ),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode(),
        "application/json; charset=utf-8",
        True,
    ),
    (
        "/v1/completions",
        json.dumps(
            {
                "model": MODEL,
                "prompt": "hi",
                "max_tokens": 1,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode(),
        "application/json",
        True,
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        ).encode(),
        "application/json",
        True,
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        ).encode(),
        "application/json",
        True,
    ),
    # a GatewayError from the route: answered by the app's handler on either path
    ("/v1/completions", json.dumps({"model": "other", "prompt": "hi"}).encode(), "application/json", True),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 10_000}).encode(),
        "application/json",
        True,
    ),
    # left to FastAPI
    ("/v1/completions", b'{"model": "tiny-kimi", "prompt": ', "application/json", False),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": 3}).encode(), "application/json", False),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi"}).encode(), "text/plain", False),
    ("/v1/completions", b"", "application/json", False),
    ("/v1/chat/completions", json.dumps([1, 2]).encode(), "application/json", False),
]


def _normalized(status: int, content_type: str, text: str) -> tuple[int, str, str]:
    """An answer without what differs per request (ids, timestamps)."""
    text = re.sub(r'"id":"[^"]*"', '"id":"-"', text)
    text = re.sub(r'"created":\d+', '"created":0', text)
    return status, content_type, text


def _answers(gateway: Any) -> list[tuple[int, str, str]]:
    answers = []
    with gateway.http() as http:
        for path, body, content_type, _ in REQUESTS:
            response = http.post(path, content=body, headers={"content-type": content_type})
            answers.append(_normalized(response.status_code, response.headers["content-type"], response.text))
    return answers


def test_direct_routes_answer_as_fastapi_does(tiny_model_path, script, monkeypatch):
    served: list[bool] = []
    serve = DirectRoutes.serve

    async def recording(self: DirectRoutes, *args: Any) -> bool:
        served.append(await serve(self, *args))
        return served[-1]

    monkeypatch.setattr(DirectRoutes, "serve", recording)
    with running_gateway(tiny_model_path, script) as gateway:
        direct = _answers(gateway)
    assert served == [expected for *_, expected in REQUESTS]

    async def never(self: DirectRoutes, *args: Any) -> bool:
        return False

    monkeypatch.setattr(DirectRoutes, "serve", never)  # every request through FastAPI alone
    with running_gateway(tiny_model_path, script) as gateway:
        through_fastapi = _answers(gateway)
    assert direct == through_fastapi
    assert [status for status, *_ in direct] == [200, 200, 200, 200, 200, 404, 400, 400, 400, 400, 400, 400]


def test_direct_routes_take_api_keys_as_fastapi_does(tiny_model_path, script):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with running_gateway(tiny_model_path, script, api_keys=("k1",)) as gateway, gateway.http() as http:
        refused = http.post("/v1/completions", json=body)
        served = http.post("/v1/completions", json=body, headers={"authorization": "Bearer k1"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert served.status_code == 200


def test_a_route_that_takes_something_else_is_refused_at_startup():
    async def extra(body: CompletionRequest, raw: Request, pipeline: Any, more: int) -> Response:
        raise AssertionError("never called")

    with pytest.raises(TypeError, match="cannot be served directly"):
        DirectRoute.of(extra)
