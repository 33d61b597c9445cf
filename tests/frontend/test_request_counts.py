"""A request's counts are checked before anything is done per item: a body of a million prompts
is refused by its count, with no work per prompt, while the gateway keeps answering others.

"No work per prompt" is measured, not timed: the Python calls the gateway makes to refuse a body
of 20,000 prompts are as many as for one just over the limit (the app runs in this thread, under
a profiler). The event loop's longest block is printed by the million-prompt test, as a figure.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from frontend.app import build_app
from frontend.request_counts import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_METADATA_ENTRIES,
    MAX_PROMPTS,
    MAX_STOP_TOKEN_IDS,
)
from frontend.router import LeastLoadRouter
from frontend.settings import GatewaySettings
from tests.frontend.conftest import MODEL

NOWHERE = "127.0.0.1:1"  # the workers are never dialled: every request here is refused first
USER_HI = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def app(tiny_model_path: Path) -> FastAPI:
    return build_app(
        GatewaySettings(model_name=MODEL), tiny_model_path, LeastLoadRouter([NOWHERE], [NOWHERE])
    )


def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def _post_counting_calls(app: FastAPI, path: str, body: dict[str, Any]) -> tuple[httpx.Response, int]:
    """The response, and the Python function calls made in this thread while it was served."""
    content = json.dumps(body).encode()
    num_calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal num_calls
        num_calls += event == "call"

    async def post() -> httpx.Response:
        async with _client(app) as http:
            # No collection while counting: it runs finalizers and gc.callbacks (hypothesis installs
            # one), Python calls that depend on what earlier tests left, not on this request.
            gc.collect()
            gc.disable()
            sys.setprofile(profile)
            try:
                return await http.post(path, content=content, headers={"content-type": "application/json"})
            finally:
                sys.setprofile(None)
                gc.enable()

    return asyncio.run(post()), num_calls


def _refusal(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize(
    ("path", "body_of", "param", "limit"),
    [
        ("/v1/completions", lambda n: {"prompt": ["a"] * n}, "prompt", MAX_PROMPTS),
        ("/v1/completions", lambda n: {"prompt": [[1, 2]] * n}, "prompt", MAX_PROMPTS),
        ("/v1/chat/completions", lambda n: {"messages": [USER_HI] * n}, "messages", MAX_MESSAGES),
        (
            "/v1/chat/completions",
            lambda n: {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * n}]},
            "messages.0.content",
            MAX_CONTENT_PARTS,
        ),
        (
            "/v1/completions",
            lambda n: {"prompt": "a", "stop_token_ids": [1] * n},
            "stop_token_ids",
            MAX_STOP_TOKEN_IDS,
        ),
        (
            "/v1/completions",
            lambda n: {"prompt": "a", "metadata": {str(i): "v" for i in range(n)}},
            "metadata",
            MAX_METADATA_ENTRIES,
        ),
    ],
)
def test_a_count_over_its_limit_is_refused_with_no_work_per_item(app: FastAPI, path, body_of, param, limit):
    just_over, calls_just_over = _post_counting_calls(app, path, body_of(limit + 1))
    far_over, calls_far_over = _post_counting_calls(app, path, body_of(20_000))
    assert f"at most {limit} are allowed" in _refusal(just_over, param)
    assert f"{param} has 20000 " in _refusal(far_over, param)
    assert calls_far_over <= calls_just_over + 50, (calls_just_over, calls_far_over)


def test_a_count_at_its_limit_is_not_refused_for_it(app: FastAPI):
    # A model name no one serves: refused (404) after every check of the body passed.
    response, _ = _post_counting_calls(
        app, "/v1/completions", {"model": "other", "prompt": ["a"] * MAX_PROMPTS}
    )
    assert response.status_code == 404, response.text


def test_a_million_prompts_are_refused_while_health_answers(app: FastAPI):
    body = json.dumps({"prompt": ["a"] * 1_000_000}).encode()  # ~5 MB

    async def scenario() -> tuple[httpx.Response, httpx.Response, float]:
        loop = asyncio.get_running_loop()
        longest_block_s, done = 0.0, asyncio.Event()

        async def probe() -> None:  # how long the loop went without running this task
            nonlocal longest_block_s
            while not done.is_set():
                before_s = loop.time()
                await asyncio.sleep(0.001)
                longest_block_s = max(longest_block_s, loop.time() - before_s - 0.001)

        probing = asyncio.create_task(probe())
        async with _client(app) as http:
            refused = asyncio.create_task(
                http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            )
            health = await http.get("/health")
            response = await refused
        done.set()
        await probing
        return response, health, longest_block_s

    response, health, longest_block_s = asyncio.run(scenario())
    assert "prompt has 1000000 prompts; at most" in _refusal(response, "prompt")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    print(
        f"\nlongest event-loop block while a 5 MB body of 1,000,000 prompts was refused: {longest_block_s * 1e3:.1f} ms"
    )
