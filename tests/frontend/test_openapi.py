"""The OpenAPI document says what the server does, and the server does what the document says:
400 (never 422) in the error shape, the other statuses it sends, `Retry-After` on 429s, `Allow`
on 405s, /metrics as text, empty prompts refused in the schema; refusals counted apart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.request_counts import MAX_MESSAGES, MAX_PROMPTS
from splitserve.tokenizer import Tokenizer
from tests.frontend.conftest import MODEL, SCRIPT_TEXT, Gateway, running_gateway
from tests.frontend.fakes import Script

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
GENERATION_ROUTES = {
    "/v1/completions": "CompletionResponse",
    "/v1/chat/completions": "ChatCompletionResponse",
}


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Gateway]:
    script = Script(Tokenizer(tiny_model_path).encode(SCRIPT_TEXT, add_special_tokens=False))
    with running_gateway(tiny_model_path, script, max_request_bytes=4096) as gw:
        yield gw


@pytest.fixture(scope="module")
def document(gateway: Gateway) -> dict[str, Any]:
    with gateway.http() as http:
        response = http.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def _operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            yield path, method, operation


def test_no_route_declares_a_422_and_every_error_has_the_error_schema(document: dict[str, Any]):
    for path, method, operation in _operations(document):
        responses = operation["responses"]
        assert "422" not in responses, (path, method)
        assert "500" in responses, (path, method)
        for status, response in responses.items():
            if int(status) >= 400 and not (path == "/health" and status == "503"):
                assert response["content"] == {"application/json": {"schema": ERROR_REF}}, (path, status)
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}


@pytest.mark.parametrize("path", sorted(GENERATION_ROUTES))
def test_generation_routes_declare_what_they_send(document: dict[str, Any], path: str):
    responses = document["paths"][path]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(responses)
    ok = responses["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{GENERATION_ROUTES[path]}"}
    assert ok["text/event-stream"]["schema"]["properties"]["data"]["type"] == "string"  # one event
    assert "Retry-After" in responses["429"]["headers"]


def test_metrics_is_declared_and_served_as_text(gateway: Gateway, document: dict[str, Any]):
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    with gateway.http() as http:
        assert http.get("/metrics").headers["content-type"].startswith("text/plain")


def test_health_declares_both_of_its_answers(document: dict[str, Any]):
    responses = document["paths"]["/health"]["get"]["responses"]
    for status in ("200", "503"):
        assert responses[status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/HealthStatus"
        }


def test_the_schema_refuses_an_empty_prompt_and_names_the_roles(document: dict[str, Any]):
    schemas = document["components"]["schemas"]
    for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        assert branch.get("minLength", 0) >= 1 or branch.get("minItems", 0) >= 1, branch
        inner = branch.get("items", {})
        if inner.get("type") in ("string", "array"):
            assert inner.get("minLength", 0) >= 1 or inner.get("minItems", 0) >= 1, branch
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == [
        "system",
        "developer",
        "user",
        "assistant",
    ]
    top_k = schemas["CompletionRequest"]["properties"]["top_k"]["anyOf"][0]
    assert top_k["maximum"] == 2**31 - 1


@pytest.mark.parametrize(
    ("method", "path", "allow"), [("GET", "/v1/completions", "POST"), ("POST", "/health", "GET")]
)
def test_a_405_says_which_methods_the_route_allows(gateway: Gateway, method: str, path: str, allow: str):
    with gateway.http() as http:
        response = http.request(method, path)
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    assert response.json()["error"]["code"] == 405


def _samples(gateway: Gateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with gateway.http() as http:
        text = http.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def test_refused_requests_are_counted_by_reason_and_not_as_processed(gateway: Gateway):
    before = _samples(gateway)
    gateway.decode.accept = False
    try:
        with gateway.http() as http:
            full = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
            bad = http.post("/v1/completions", json={"prompt": "hi", "temperature": -1})
            too_large = http.post(
                "/v1/completions", content=b" " * 5000, headers={"content-type": "application/json"}
            )
    finally:
        gateway.decode.accept = True
    assert full.status_code == 429 and full.headers["retry-after"].isdigit()
    assert (bad.status_code, too_large.status_code) == (400, 413)
    after = _samples(gateway)
    for reason in ("over_capacity", "invalid_request", "body_too_large"):
        name = "splitserve_request_refusals_total"
        assert _value(after, name, reason=reason) == _value(before, name, reason=reason) + 1, reason
    for name in ("splitserve_prompt_tokens_total", "splitserve_request_prompt_tokens_count"):
        assert _value(after, name) == _value(before, name), name
    assert sum(v for (n, _), v in after.items() if n == "splitserve_request_success_total") == sum(
        v for (n, _), v in before.items() if n == "splitserve_request_success_total"
    )

    with gateway.http() as http:
        served = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
    assert served.status_code == 200
    num_prompt_tokens = served.json()["usage"]["prompt_tokens"]
    final = _samples(gateway)
    assert _value(final, "splitserve_prompt_tokens_total") == _value(
        after, "splitserve_prompt_tokens_total"
    ) + (num_prompt_tokens)


def test_the_schemas_use_json_schema_keywords_only(document: dict[str, Any]):
    """pydantic writes a bound it cannot place as `ge`/`le`, which validators silently ignore."""

    def keys(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield key
                if key != "properties":  # property names are names, not keywords
                    yield from keys(value)
                else:
                    for child in value.values():
                        yield from keys(child)
        elif isinstance(node, list):
            for item in node:
                yield from keys(item)

    assert not {"ge", "le", "gt", "lt"} & set(keys(document["components"]["schemas"]))


def test_the_document_states_the_limits_the_server_enforces(
    gateway: Gateway, document: dict[str, Any], tiny_model_path: Path
):
    schemas = document["components"]["schemas"]
    completion, chat = (
        schemas["CompletionRequest"]["properties"],
        schemas["ChatCompletionRequest"]["properties"],
    )
    message = schemas["ChatMessage"]
    assert "content" in message["required"]
    assert {"type": "null"} not in message["properties"]["content"]["anyOf"]  # null is refused
    max_new_tokens = gateway.settings.max_model_len - 1  # a prompt has at least one token
    for field in (completion["max_tokens"], chat["max_tokens"], chat["max_completion_tokens"]):
        assert (field["anyOf"][0]["minimum"], field["anyOf"][0]["maximum"]) == (1, max_new_tokens)
    for field in (completion["logprobs"], chat["top_logprobs"]):
        assert (field["anyOf"][0]["minimum"], field["anyOf"][0]["maximum"]) == (0, 20)
    top_p = completion["top_p"]["anyOf"][0]
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0, 1)
    assert completion["seed"]["anyOf"][0] == {"type": "integer", "minimum": 0, "exclusiveMaximum": 2**63}
    vocab_size = Tokenizer(tiny_model_path).vocab_size
    ids = completion["prompt"]["anyOf"][2]["items"]
    assert (ids["minimum"], ids["maximum"]) == (0, vocab_size - 1)
    assert completion["prompt"]["anyOf"][0]["maxLength"] == gateway.settings.prompt_chars_limit
    assert completion["prompt"]["anyOf"][1]["maxItems"] == MAX_PROMPTS
    assert chat["messages"]["maxItems"] == MAX_MESSAGES
    assert schemas["ChatCompletionRequest"]["allOf"] and completion["tool_choice"]["enum"] == [
        None,
        False,
        "",
        [],
        {},
        "none",
    ]


def test_integer_limits_are_written_as_integers(gateway: Gateway):
    """FastAPI's document model makes every bound a float: 2**63 - 1 came out as 2**63."""
    with gateway.http() as http:
        text = http.get("/openapi.json").text
    assert '"exclusiveMaximum":9223372036854775808' in text.replace(" ", "")
    assert "2147483647.0" not in text and "x-splitserve-bound" not in text
