"""Inputs that crashed the gateway or were silently ignored: each is now a 400 naming the field,
before any worker is touched, and no error body carries internal exception text."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from frontend.request_checks import REFUSED_FIELDS, lone_surrogate_path
from splitserve.tokenizer import Tokenizer
from tests.frontend.conftest import MODEL, SCRIPT_TEXT, Gateway, running_gateway
from tests.frontend.fakes import Script

INT32_OVER = 2**31
USER_HI = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Gateway]:
    script = Script(Tokenizer(tiny_model_path).encode(SCRIPT_TEXT, add_special_tokens=False))
    with running_gateway(tiny_model_path, script) as gw:
        yield gw


def _post_raw(gateway: Gateway, path: str, text: str) -> httpx.Response:
    """POST JSON text as it is: `\\ud800` escapes stay lone surrogates once parsed."""
    with gateway.http() as http:
        return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


def _post(gateway: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return _post_raw(gateway, path, json.dumps({"model": MODEL, **body}))  # ensure_ascii: escapes kept


def _refused(response: httpx.Response, param: str | None) -> str:
    assert response.status_code == 400, response.text
    assert response.content.isascii()  # whatever the request held, the body renders
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return str(error["message"])


def _workers_untouched(gateway: Gateway, before: tuple[int, int]) -> None:
    assert (len(gateway.decode.reserves), len(gateway.prefill.requests)) == before


def _counts(gateway: Gateway) -> tuple[int, int]:
    return len(gateway.decode.reserves), len(gateway.prefill.requests)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", "\udfff"]}, "prompt.1"),
        ("/v1/completions", {"prompt": "hi", "stop": "\ud800"}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": ["ok", "x\ud800"]}, "stop.1"),
        ("/v1/completions", {"prompt": "hi", "user": "\ud800"}, "user"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [USER_HI, {"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
            "messages.1.content.0.text",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
            "messages.0.name",
        ),
        ("/v1/chat/completions", {"messages": [USER_HI], "stop": "\ud800"}, "stop"),
        (
            "/v1/chat/completions",
            {"messages": [USER_HI], "chat_template_kwargs": {"x": "\ud800"}},
            "chat_template_kwargs.x",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where_it_is(gateway: Gateway, path: str, body: dict, param: str):
    before = _counts(gateway)
    message = _refused(_post(gateway, path, body), param)
    assert "lone UTF-16 surrogate" in message
    _workers_untouched(gateway, before)


def test_a_lone_surrogate_in_the_model_name_or_a_field_name_is_a_400_too(gateway: Gateway):
    _refused(_post(gateway, "/v1/completions", {"prompt": "hi", "model": "\ud800"}), "model")
    _refused(_post(gateway, "/v1/completions", {"prompt": "hi", "\ud800": 1}), "<field name>")


def test_lone_surrogate_path_finds_the_first_one_and_passes_pairs():
    pair = json.loads('{"a": ["ok", {"b": "\\ud83d\\ude00"}]}')  # an escaped pair: one emoji
    assert pair["a"][1]["b"] == "\U0001f600" and lone_surrogate_path(pair) is None
    assert lone_surrogate_path({"a": ["ok", {"b": "x\ud83d"}]}) == "a.1.b"
    assert lone_surrogate_path("\ud800") == ""


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "top_k": INT32_OVER}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "top_k": -(2**31) - 1}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [5, INT32_OVER]}, "stop_token_ids.1"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": INT32_OVER}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": INT32_OVER}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "logprobs": INT32_OVER}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "n": INT32_OVER}, "n"),
        ("/v1/completions", {"prompt": "hi", "best_of": INT32_OVER}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**63}, "seed"),
        ("/v1/completions", {"prompt": [1, INT32_OVER]}, "prompt"),
        ("/v1/completions", {"prompt": [[1], [2, INT32_OVER]]}, "prompt"),
        ("/v1/chat/completions", {"messages": [USER_HI], "top_k": INT32_OVER}, "top_k"),
        ("/v1/chat/completions", {"messages": [USER_HI], "stop_token_ids": [INT32_OVER]}, "stop_token_ids.0"),
        (
            "/v1/chat/completions",
            {"messages": [USER_HI], "max_completion_tokens": INT32_OVER},
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [USER_HI], "logprobs": True, "top_logprobs": INT32_OVER},
            "top_logprobs",
        ),
    ],
)
def test_an_integer_past_int32_is_a_400_naming_the_field(gateway: Gateway, path: str, body: dict, param: str):
    before = _counts(gateway)
    _refused(_post(gateway, path, body), param)
    _workers_untouched(gateway, before)


def test_the_largest_int32_top_k_reaches_the_workers(gateway: Gateway):
    response = _post(gateway, "/v1/completions", {"prompt": "hi", "top_k": 2**31 - 1, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert gateway.prefill.requests[-1].sampling_params.top_k == 2**31 - 1


def test_token_ids_past_int32_are_a_400_without_a_tokenizer_too(script: Script):
    with running_gateway(None, script) as gateway:
        _refused(_post(gateway, "/v1/completions", {"prompt": [INT32_OVER]}), "prompt")
        _refused(
            _post(gateway, "/v1/completions", {"prompt": [1], "stop_token_ids": [INT32_OVER]}),
            "stop_token_ids.0",
        )
        assert _counts(gateway) == (0, 0)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_non_finite_float_is_a_400(gateway: Gateway, value: str):
    text = f'{{"prompt": "hi", "temperature": {value}}}'
    _refused(_post_raw(gateway, "/v1/completions", text), "temperature")


# A value asking for something, for each refused field.
ASKS: dict[str, Any] = {
    "tool_choice": "auto",
    "function_call": "auto",
    "functions": [{"name": "f"}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "draft"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
    "service_tier": "priority",
    "length_penalty": 0.5,
    "priority": 3,
}


@pytest.mark.parametrize("field", sorted(REFUSED_FIELDS))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_field_whose_effect_this_server_cannot_give_is_a_400_naming_it(
    gateway: Gateway, field: str, path: str
):
    body: dict[str, Any] = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [USER_HI]}
    body[field] = ASKS.get(field, {"any": "thing"} if field == "structured_outputs" else "asked")
    before = _counts(gateway)
    message = _refused(_post(gateway, path, body), field)
    assert message.startswith(f"{field} is not supported: ")
    _workers_untouched(gateway, before)


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "none"},
        {"tool_choice": None, "functions": []},
        {"modalities": ["text"]},
        {"service_tier": "auto"},
        {"priority": 0, "length_penalty": 1.0},
        {"reasoning_effort": None, "prediction": None},
        {
            "metadata": {"k": "v"},
            "store": True,
            "parallel_tool_calls": False,
            "prompt_cache_key": "p",
            "safety_identifier": "s",
            "user": "u",
        },
    ],
)
def test_values_that_ask_for_nothing_are_accepted_without_an_unknown_field_warning(
    gateway: Gateway, extra: dict, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.WARNING, logger="frontend.request_checks"):
        response = _post(gateway, "/v1/chat/completions", {"messages": [USER_HI], "max_tokens": 2, **extra})
    assert response.status_code == 200, response.text
    assert not [r for r in caplog.records if r.name == "frontend.request_checks"]


def test_stream_options_continuous_usage_stats_is_refused_and_unknown_stream_options_too(gateway: Gateway):
    body = {"prompt": "hi", "stream": True}
    _refused(
        _post(gateway, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}}),
        "stream_options.continuous_usage_stats",
    )
    _refused(
        _post(gateway, "/v1/completions", {**body, "stream_options": {"per_token": True}}),
        "stream_options.per_token",
    )
    ok = _post(
        gateway, "/v1/completions", {**body, "max_tokens": 2, "stream_options": {"include_obfuscation": True}}
    )
    assert ok.status_code == 200 and ok.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("role", ["tool", "function", "bogus", "ASSISTANT"])
def test_an_unsupported_chat_role_is_a_400(gateway: Gateway, role: str):
    body = {"messages": [{"role": role, "content": "hi", "tool_call_id": "c1"}]}
    assert "is not supported" in _refused(_post(gateway, "/v1/chat/completions", body), "messages.0.role")


def test_a_crash_in_the_gateway_is_a_generic_500_with_an_id_whose_traceback_is_logged(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    def crash(*args: object, **kwargs: object) -> list[str]:
        raise RuntimeError("secret detail at /srv/internal/path")

    monkeypatch.setattr(gateway.router, "rank_decode", crash)
    for stream in (False, True):
        with caplog.at_level(logging.ERROR, logger="frontend.errors"):
            response = _post(gateway, "/v1/completions", {"prompt": "hi", "stream": stream})
        assert response.status_code == 500
        error = response.json()["error"]
        assert "secret" not in response.text and "RuntimeError" not in response.text
        error_id = error["message"].rsplit(" ", 1)[-1]
        logged = [r for r in caplog.records if error_id in r.getMessage()]
        assert logged and logged[0].exc_info is not None and "secret detail" in str(logged[0].exc_info[1])


@pytest.mark.parametrize(
    ("body", "content_type", "words"),
    [
        (b"[]", "application/json", "must be a JSON object"),
        (b"null", "application/json", "must be a JSON object"),
        (b'{"prompt": "hi"}', "text/plain", "Content-Type: application/json"),
        (b'{"prompt": "\xff\xfe"}', "application/json", "could not be parsed as JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", "could not be parsed as JSON"),
        (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", "could not be parsed"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_a_400_saying_so(
    gateway: Gateway, body: bytes, content_type: str, words: str
):
    with gateway.http() as http:
        response = http.post("/v1/completions", content=body, headers={"content-type": content_type})
    assert words in _refused(response, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("echo", 0.0),
        ("stream", "true"),
        ("ignore_eos", 1),
        ("max_tokens", "5"),
        ("max_tokens", 5.5),
        ("top_k", True),
        ("temperature", "0.5"),
    ],
)
def test_a_value_of_another_json_type_than_the_schema_names_is_a_400(
    gateway: Gateway, field: str, value: Any
):
    before = _counts(gateway)
    _refused(_post(gateway, "/v1/completions", {"prompt": "hi", field: value}), field)
    _workers_untouched(gateway, before)


def test_an_integer_where_a_number_is_named_is_accepted(gateway: Gateway):
    response = _post(
        gateway, "/v1/completions", {"prompt": "hi", "temperature": 0, "top_p": 1, "max_tokens": 2}
    )
    assert response.status_code == 200, response.text


def test_a_whole_float_where_an_integer_is_named_is_that_integer(gateway: Gateway):
    # JSON Schema counts 2.0 as an integer, so the document promises it is taken
    body = {"prompt": [5.0, 6.0], "max_tokens": 2.0, "stop_token_ids": [7.0], "seed": 3.0}
    response = _post(gateway, "/v1/completions", body)
    assert response.status_code == 200, response.text
    sent = gateway.prefill.requests[-1]
    assert list(sent.prompt_token_ids) == [5, 6] and list(sent.sampling_params.stop_token_ids) == [7]
    assert sent.sampling_params.max_tokens == 2 and sent.sampling_params.seed == 3


@pytest.mark.parametrize(
    ("field", "value"), [("echo", 0), ("length_penalty", True), ("priority", 0.5), ("modalities", "text")]
)
def test_a_refused_field_asks_for_nothing_only_with_the_json_values_the_document_lists(
    gateway: Gateway, field: str, value: Any
):
    """The check compares as JSON Schema's `enum` does: 0 is not false, true is not 1."""
    _refused(_post(gateway, "/v1/chat/completions", {"messages": [USER_HI], field: value}), field)
