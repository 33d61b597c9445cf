"""schemathesis against the gateway's own /openapi.json, with fake workers behind the gateway: no
5xx, every response what the document declares (status, content type, body schema); and the
schemathesis command with every check (`--checks all`: schema-valid requests accepted, invalid
ones refused, methods, headers...) finds nothing but what no JSON Schema can state (the few
refusals `schemathesis_hooks.py` names, each with its reason).

The examples are bounded and derandomized, so the run is short and the same every time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
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
from tests.frontend.conftest import SCRIPT_TEXT, Gateway, running_gateway
from tests.frontend.fakes import Script
from tests.frontend.schemathesis_hooks import inexpressible

REPO = Path(__file__).resolve().parents[2]

# per operation and mode: the suite's run takes well under a minute here; set the variable for a
# longer hunt (`SPLITSERVE_SCHEMATHESIS_EXAMPLES=2000 pytest tests/frontend/test_schemathesis.py`)
MAX_EXAMPLES = int(os.environ.get("SPLITSERVE_SCHEMATHESIS_EXAMPLES", "40"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Gateway]:
    script = Script(Tokenizer(tiny_model_path).encode(SCRIPT_TEXT, add_special_tokens=False))
    # Prefix caching off: the fakes answer no Prefill.CacheReport, and each failed poll has gRPC log a
    # traceback on a server thread; on Python 3.11 formatting one parses source (ast), which once
    # broke hypothesis's own parsing on the main thread ("AST constructor recursion depth mismatch").
    with running_gateway(tiny_model_path, script, enable_prefix_caching=False) as gw:
        yield gw


@pytest.fixture(scope="module")
def gateway_schema(gateway: Gateway) -> schemathesis.Schema:
    return schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")


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


def run_every_check(gateway: Gateway, *arguments: str) -> subprocess.CompletedProcess[str]:
    """`schemathesis run --checks all` against the gateway, with the hooks that drop what no schema
    can state; the served document unless `arguments` name another."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", "--checks", "all", "--continue-on-failure"]
    command += ["--generation-deterministic", "-n", str(MAX_EXAMPLES), "--no-color"]
    command += list(arguments) or [f"{gateway.url}/openapi.json"]
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.frontend.schemathesis_hooks", "PYTHONPATH": python_path}
    with tempfile.TemporaryDirectory() as scratch:  # where the command keeps its cache
        return subprocess.run(
            command, env=env, cwd=scratch, capture_output=True, text=True, timeout=600, check=False
        )


def test_every_schemathesis_check_finds_nothing_a_schema_could_state(gateway: Gateway):
    run = run_every_check(gateway)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failure" not in run.stdout.split("Test cases:")[-1]


def test_every_check_fails_on_a_document_that_leaves_out_a_limit(gateway: Gateway, tmp_path: Path):
    """The run above can fail: with `top_p`'s bounds left out of the document, a schema-valid
    top_p of 0 or 5 is refused by the server, and the run says so."""
    with httpx.Client() as http:
        document = http.get(f"{gateway.url}/openapi.json").json()
    top_p = document["components"]["schemas"]["CompletionRequest"]["properties"]["top_p"]["anyOf"][0]
    del top_p["exclusiveMinimum"], top_p["maximum"]
    (tmp_path / "openapi.json").write_text(json.dumps(document))
    only = ["--url", gateway.url, "--phases", "coverage", "--include-path", "/v1/completions"]
    run = run_every_check(gateway, str(tmp_path / "openapi.json"), *only)
    assert run.returncode != 0 and "Schema-valid request rejected" in run.stdout, run.stdout[-4000:]
    assert "top_p must be in (0, 1]" in run.stdout


@pytest.mark.parametrize(
    ("status_code", "error", "expressible"),
    [
        (400, {"message": "top_p must be in (0, 1] (got 5)", "code": 400}, True),
        (
            400,
            {"message": "prompt has 300 tokens; this model's context is 256 tokens ...", "code": 400},
            False,
        ),
        (400, {"message": "this request needs 9 decode slots ...", "code": "request_too_large"}, False),
        (413, {"message": "this model's context is", "code": 413}, True),
    ],
)
def test_only_refusals_no_schema_can_state_are_let_through(status_code: int, error: dict, expressible: bool):
    assert (inexpressible(status_code, json.dumps({"error": error})) is None) == expressible
