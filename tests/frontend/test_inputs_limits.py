"""Size limits apply before the work: a body over `max_request_bytes` is a 413 before its JSON is
parsed, a text over `max_prompt_chars` a 400 before it is tokenized; and the keys reach the
gateway from the cluster config."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy.actors import gateway_settings_kwargs
from frontend.request_checks import MAX_LOGGED_FIELDS, MAX_LOGGED_NAME_CHARS
from frontend.settings import CHARS_PER_TOKEN_BOUND, GatewaySettings
from splitserve.config import ClusterConfig
from splitserve.tokenizer import Tokenizer
from tests.frontend.conftest import MODEL, SCRIPT_TEXT, Gateway, running_gateway
from tests.frontend.fakes import Script

MAX_REQUEST_BYTES = 2048
MAX_PROMPT_CHARS = 300


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Gateway]:
    script = Script(Tokenizer(tiny_model_path).encode(SCRIPT_TEXT, add_special_tokens=False))
    with running_gateway(
        tiny_model_path, script, max_request_bytes=MAX_REQUEST_BYTES, max_prompt_chars=MAX_PROMPT_CHARS
    ) as gw:
        yield gw


@pytest.fixture
def tokenize_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every text the gateway's tokenizer is asked to encode (the gateway runs in this process)."""
    calls: list[str] = []
    original = Tokenizer.encode_releasing_gil

    def spy(self: Tokenizer, text: str, *args: object, **kwargs: object) -> list[int]:
        calls.append(text)
        return original(self, text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Tokenizer, "encode_releasing_gil", spy)
    return calls


def _error(response: httpx.Response, status_code: int) -> dict:
    assert response.status_code == status_code, response.text
    return response.json()["error"]


def test_a_body_declared_over_the_limit_is_a_413_before_it_is_parsed(gateway: Gateway):
    not_json = b"{" * (MAX_REQUEST_BYTES + 1)  # parsed, it would be a 400
    with gateway.http() as http:
        response = http.post(
            "/v1/completions", content=not_json, headers={"content-type": "application/json"}
        )
    error = _error(response, 413)
    assert error["type"] == "invalid_request_error" and error["code"] == 413
    assert (
        f"at most {MAX_REQUEST_BYTES} bytes" in error["message"]
        and "gateway.max_request_bytes" in error["message"]
    )
    assert gateway.prefill.requests == []


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(gateway: Gateway):
    def chunks() -> Iterator[bytes]:
        for _ in range(64):  # 64 KiB offered; the gateway stops reading past 2 KiB
            yield b" " * 1024

    with gateway.http() as http:
        response = http.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert "content-length" not in response.request.headers  # it did go chunked
    assert _error(response, 413)["code"] == 413


def test_a_chunked_body_under_the_limit_is_served(gateway: Gateway):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()

    def chunks() -> Iterator[bytes]:
        yield body[:10]
        yield body[10:]

    with gateway.http() as http:
        response = http.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_a_prompt_over_the_character_limit_is_a_400_and_never_tokenized(
    gateway: Gateway, tokenize_calls: list[str]
):
    long_text = "x" * (MAX_PROMPT_CHARS + 1)
    with gateway.http() as http:
        completion = http.post("/v1/completions", json={"prompt": ["fine", long_text]})
        chat = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "y" * 200}, {"role": "user", "content": "z" * 200}]
            },
        )
    error = _error(completion, 400)
    assert error["param"] == "prompt"
    assert (
        f"{MAX_PROMPT_CHARS + 1} characters" in error["message"]
        and f"at most {MAX_PROMPT_CHARS}" in error["message"]
    )
    assert _error(chat, 400)["param"] == "messages"  # the messages together are over it
    assert tokenize_calls == []
    with gateway.http() as http:
        at_limit = http.post("/v1/completions", json={"prompt": "x" * MAX_PROMPT_CHARS, "max_tokens": 1})
    assert at_limit.status_code in (200, 400) and tokenize_calls  # tokenized: within the limit
    if at_limit.status_code == 400:
        assert "characters" not in at_limit.json()["error"]["message"]


# A chat template that shows each message's name and `reasoning_content`, and a `persona` argument.
SHOWING_TEMPLATE = (
    "{%- if persona -%}<|im_system|>{{ persona }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}<|im_user|>{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}"
    "{% if m.reasoning_content %} {{ m.reasoning_content }}{% endif %}<|im_middle|>{{ m['content'] }}"
    "<|im_end|>{%- endfor -%}<|im_assistant|>assistant<|im_middle|>"
)


@pytest.fixture(scope="module")
def showing_gateway(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("showing-template")
    shutil.copy(tiny_model_path / "tokenizer.json", folder)
    config = json.loads((tiny_model_path / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": SHOWING_TEMPLATE}))
    script = Script(Tokenizer(folder).encode(SCRIPT_TEXT, add_special_tokens=False))
    with running_gateway(folder, script, max_prompt_chars=MAX_PROMPT_CHARS) as gw:
        yield gw


@pytest.mark.parametrize(
    "extra",
    [
        {"messages": [{"role": "user", "content": "hi", "name": "n" * MAX_PROMPT_CHARS}]},
        {"messages": [{"role": "user", "content": "hi", "reasoning_content": "r" * MAX_PROMPT_CHARS}]},
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"persona": "p" * MAX_PROMPT_CHARS},
        },
    ],
    ids=["name", "extra field", "template argument"],
)
def test_the_character_limit_counts_what_the_chat_template_renders(
    showing_gateway: Gateway, tokenize_calls: list[str], extra: dict
):
    with showing_gateway.http() as http:
        response = http.post("/v1/chat/completions", json={"max_tokens": 1, **extra})
    error = _error(response, 400)
    assert error["param"] == "messages" and f"at most {MAX_PROMPT_CHARS}" in error["message"]
    assert "as the template renders them" in error["message"]
    assert tokenize_calls == []


def test_what_the_chat_template_does_not_render_is_not_counted(
    showing_gateway: Gateway, tokenize_calls: list[str]
):
    message = {"role": "user", "content": "hi", "unshown": "u" * (4 * MAX_PROMPT_CHARS)}
    with showing_gateway.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert len(tokenize_calls) == 1 and "u" * 10 not in tokenize_calls[0]


def test_the_default_character_limit_follows_the_context():
    settings = GatewaySettings(max_model_len=1000)
    assert settings.prompt_chars_limit == CHARS_PER_TOKEN_BOUND * 1000
    assert GatewaySettings(max_model_len=1000, max_prompt_chars=7).prompt_chars_limit == 7


def test_the_limits_reach_the_gateway_from_the_cluster_config():
    config = ClusterConfig.model_validate(
        {"gateway": {"max_request_bytes": "1MiB", "max_prompt_chars": 5000}, "model": {"max_model_len": 512}}
    )
    settings = GatewaySettings(**gateway_settings_kwargs(config, None))
    assert settings.max_request_bytes == 2**20 and settings.max_prompt_chars == 5000
    default = GatewaySettings(**gateway_settings_kwargs(ClusterConfig(), None))
    assert default.max_request_bytes == 8 * 2**20 and default.max_prompt_chars is None


def test_the_connection_limits_reach_the_gateway_from_the_cluster_config():
    keys = {
        "header_read_timeout_s": 7.5,
        "body_read_timeout_s": 3,
        "request_read_timeout_s": 60,
        "keep_alive_timeout_s": 2,
        "max_connections_per_client": None,
    }
    settings = GatewaySettings(
        **gateway_settings_kwargs(ClusterConfig.model_validate({"gateway": keys}), None)
    )
    assert {key: getattr(settings, key) for key in keys} == keys
    default = GatewaySettings(**gateway_settings_kwargs(ClusterConfig(), None))
    assert default.max_connections_per_client == GatewaySettings().max_connections_per_client == 1024


def test_unknown_field_names_are_logged_once_escaped_and_bounded(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
):
    names = ["evil\nFORGED log line", "\x1b[31mred\x1b[0m", "n" * 1000] + [f"extra_{i}" for i in range(20)]
    with caplog.at_level(logging.WARNING, logger="frontend.request_checks"), gateway.http() as http:
        response = http.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 1, **dict.fromkeys(names, 1)}
        )
    assert response.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if r.name == "frontend.request_checks"]
    assert len(lines) == 1
    line = lines[0]
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "\\n" in line and "\\x1b" in line  # escaped, still readable
    assert f"and {len(names) - MAX_LOGGED_FIELDS} more" in line
    assert len(line) < 100 + MAX_LOGGED_FIELDS * (4 * MAX_LOGGED_NAME_CHARS + 10)
