"""schemathesis against the gateway's own /openapi.json: no 5xx, and every response what the
document declares (status, content type, body schema), with fake workers behind the gateway.

The examples are bounded and derandomized, so the run is short and the same every time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from splitserve.tokenizer import Tokenizer
from tests.frontend.conftest import SCRIPT_TEXT, running_gateway
from tests.frontend.fakes import Script

# per operation and mode: the suite's run takes well under a minute here; set the variable for a
# longer hunt (`SPLITSERVE_SCHEMATHESIS_EXAMPLES=2000 pytest tests/frontend/test_schemathesis.py`)
MAX_EXAMPLES = int(os.environ.get("SPLITSERVE_SCHEMATHESIS_EXAMPLES", "40"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def gateway_schema(tiny_model_path: Path) -> Iterator[schemathesis.Schema]:
    script = Script(Tokenizer(tiny_model_path).encode(SCRIPT_TEXT, add_special_tokens=False))
    # Prefix caching off: the fakes answer no Prefill.CacheReport, and each failed poll has gRPC log a
    # traceback on a server thread; on Python 3.11 formatting one parses source (ast), which once
    # broke hypothesis's own parsing on the main thread ("AST constructor recursion depth mismatch").
    with running_gateway(tiny_model_path, script, enable_prefix_caching=False) as gateway:
        yield schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]
# Bodies that break the schema: only the routes that take one.
RUNS = [(*op, POSITIVE) for op in OPERATIONS] + [(*op, NEGATIVE) for op in OPERATIONS if op[0] == "POST"]


def test_the_document_lists_every_route_the_test_runs(gateway_schema: schemathesis.Schema) -> None:
    listed = {
        (result.ok().method.upper(), result.ok().path) for result in gateway_schema.get_all_operations()
    }
    assert listed == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path", "mode"), RUNS)
def test_every_response_is_what_the_openapi_document_declares(
    gateway_schema: schemathesis.Schema, method: str, path: str, mode: GenerationMode
) -> None:
    operation = gateway_schema[path][method]
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def call(case: schemathesis.Case) -> None:
        statuses.append(case.call_and_validate(checks=CHECKS).status_code)

    call()
    if method == "POST":  # the run did run (a route without parameters has one case to draw)
        assert len(statuses) >= min(MAX_EXAMPLES, 10), statuses
    # (served responses, whole and streamed, are checked below whatever the random bodies reach)
    if mode == NEGATIVE:  # a body the schema refuses, the server refuses too
        assert statuses and all(400 <= status < 500 for status in statuses), statuses


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": ["Hello", "world"], "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_served_response_whole_or_streamed_is_what_the_document_declares(
    gateway_schema: schemathesis.Schema, path: str, body: dict, stream: bool
) -> None:
    """Random bodies seldom ask for a stream that is served: one of each, checked the same way."""
    case = gateway_schema[path]["POST"].Case(body={**body, "stream": stream}, media_type="application/json")
    response = case.call_and_validate(checks=CHECKS)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith(
        "text/event-stream" if stream else "application/json"
    )
