"""Every failure leaves as OpenAI JSON with the right status, and before any worker is touched."""

from __future__ import annotations

import socket

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.frontend.conftest import MODEL, Gateway, running_gateway


def _error(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _assert_no_worker_touched(gateway: Gateway) -> None:
    assert gateway.decode.reserves == [] and gateway.prefill.requests == []


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [[]]}, "prompt", "empty"),
        ({"prompt": "hi", "temperature": -1}, "temperature", "temperature must be >= 0"),
        ({"prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": "hi", "n": 17}, "n", "less than or equal to 16"),
        ({"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", "integer"),
        ({"prompt": "hi", "stop": 5}, "stop", ""),
        ({"prompt": {"text": "hi"}}, "prompt", "prompt must be"),
        ({"prompt": ["a", [1, 2]]}, "prompt", "prompt must be"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs"),
        ({"prompt": "hi", "seed": -1}, "seed", "seed"),
        ({"prompt": "hi", "echo": True}, "echo", "echo"),
        ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of", "best_of must be in [n, 16]"),
        ({"prompt": "hi", "best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
        ({"prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias", "logit_bias"),
        ({"prompt": [999999]}, "prompt", "out of range"),
        ({"prompt": "hi", "stop_token_ids": [5, 2048]}, "stop_token_ids", "the vocabulary has 2048 tokens"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
        ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
    ],
)
def test_bad_completion_requests_get_a_400_naming_the_field(gateway: Gateway, body, param, words):
    with gateway.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]
    _assert_no_worker_touched(gateway)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_chat_requests_get_a_400(gateway: Gateway, body, param):
    with gateway.http() as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 400
    assert _error(response)["param"] == param
    _assert_no_worker_touched(gateway)


USER_HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": [USER_HI], "logprobs": True, "top_logprobs": 50}, "top_logprobs", "[0, 20] (got 50)"),
        ({"messages": [USER_HI], "logprobs": True, "top_logprobs": -1}, "top_logprobs", "[0, 20]"),
        ({"messages": [USER_HI], "stop_token_ids": [4096]}, "stop_token_ids", "vocabulary has 2048"),
        (
            {"messages": [{"role": "bogus", "content": "hi"}]},
            "messages.0.role",
            "system, developer, user, assistant",
        ),
        ({"messages": [USER_HI, {"role": "assistant", "content": None}]}, "messages.1.content", "not null"),
        ({"messages": [USER_HI, {"role": "assistant"}]}, "messages.1.content", "not null"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content",
            "string 'text'",
        ),
    ],
)
def test_bad_chat_fields_get_a_400_naming_the_field_and_its_limit(gateway: Gateway, body, param, words):
    with gateway.http() as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == param
    assert words in error["message"], error["message"]
    _assert_no_worker_touched(gateway)


def test_an_assistant_message_with_tool_calls_and_null_content_is_refused_by_index(gateway: Gateway):
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [USER_HI, {"role": "assistant", "content": None, "tool_calls": [tool_call]}, USER_HI]
    with gateway.http() as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status_code == 400
    error = _error(response)
    assert error["param"] == "messages.1.content" and "tool calls" in error["message"]


def test_invalid_json_gets_a_400(gateway: Gateway):
    with gateway.http() as http:
        response = http.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    error = _error(response)
    assert error["message"].startswith("the request body is not valid JSON"), error
    assert error["param"] is None


def test_prompt_longer_than_the_context_names_both_numbers(gateway: Gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().completions.create(model=MODEL, prompt=list(range(3, 303)), max_tokens=1)
    message = caught.value.body["message"]
    assert "300" in message and "256" in message
    _assert_no_worker_touched(gateway)


def test_prompt_plus_max_tokens_past_the_context_names_the_numbers(gateway: Gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().completions.create(model=MODEL, prompt=list(range(3, 203)), max_tokens=100)
    message = caught.value.body["message"]
    assert "200" in message and "100" in message and "256" in message
    _assert_no_worker_touched(gateway)


def test_unknown_model_is_a_404(gateway: Gateway):
    with pytest.raises(openai.NotFoundError) as caught:
        gateway.openai().completions.create(model="gpt-9", prompt="hi")
    assert "gpt-9" in caught.value.body["message"] and MODEL in caught.value.body["message"]
    _assert_no_worker_touched(gateway)


def test_unknown_route_is_openai_json(gateway: Gateway):
    with gateway.http() as http:
        response = http.get("/v1/nothing-here")
    assert response.status_code == 404
    _error(response)


def test_api_keys_are_required_when_configured(tiny_model_path, script):
    with running_gateway(tiny_model_path, script, api_keys=("sk-right",)) as gateway:
        with pytest.raises(openai.AuthenticationError):
            gateway.openai(api_key="sk-wrong").completions.create(model=MODEL, prompt="hi")
        with gateway.http() as http:
            missing = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert missing.status_code == 401
            assert _error(missing)["code"] == "invalid_api_key"
            assert http.get("/v1/models").status_code == 401
            assert http.get("/health").status_code == 200  # probes need no key
        _assert_no_worker_touched(gateway)
        result = gateway.openai(api_key="sk-right").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert result.choices[0].finish_reason == "length"


def test_every_decode_worker_rejecting_is_a_429(tiny_model_path, script):
    with running_gateway(tiny_model_path, script, num_decode=2) as gateway:
        for fake in gateway.decodes:
            fake.accept = False
        with pytest.raises(openai.RateLimitError) as caught:
            gateway.openai().completions.create(model=MODEL, prompt="hi")
        assert "no free state slots" in caught.value.body["message"]
        assert [len(f.reserves) for f in gateway.decodes] == [1, 1]  # both were tried
        assert gateway.prefill.requests == []


def test_streaming_request_rejected_everywhere_is_still_a_429(tiny_model_path, script):
    with running_gateway(tiny_model_path, script) as gateway:
        gateway.decode.accept = False
        with gateway.http() as http:
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
        assert response.status_code == 429
        assert _error(response)["type"] == "rate_limit_error"


def test_a_rejecting_decode_worker_falls_back_to_another(tiny_model_path, script):
    with running_gateway(tiny_model_path, script, num_decode=2) as gateway:
        gateway.decodes[0].accept = False
        for _ in range(3):
            result = gateway.openai().completions.create(model=MODEL, prompt="hi", max_tokens=3)
            assert result.choices[0].finish_reason == "length"
        assert len(gateway.decodes[1].decodes) == 3
        assert gateway.decodes[0].decodes == []


def _closed_port_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_no_workers_is_a_503(tiny_model_path, script):
    with running_gateway(tiny_model_path, script, num_prefill=0, num_decode=0) as gateway:
        with pytest.raises(openai.InternalServerError) as caught:
            gateway.openai().completions.create(model=MODEL, prompt="hi")
        assert caught.value.status_code == 503
        with gateway.http() as http:
            assert http.get("/health").status_code == 503


def test_unreachable_decode_worker_is_a_503(tiny_model_path, script):
    address = _closed_port_address()
    with running_gateway(
        tiny_model_path, script, num_decode=0, extra_decode_addresses=[address], decode_failover_wait_s=0.5
    ) as gw:
        with pytest.raises(openai.InternalServerError) as caught:
            gw.openai().completions.create(model=MODEL, prompt="hi")
        assert caught.value.status_code == 503
        assert address in caught.value.body["message"]  # the Reserve's failure, or its Stats'
        with gw.http() as http:
            health = http.get("/health")
        assert health.status_code == 503 and health.json()["decode_workers"] == 0
        assert any(address in line for line in health.json()["problems"]), health.json()


def test_an_unreachable_prefill_worker_falls_back_to_the_decode_worker(tiny_model_path, script):
    """Its prompt runs on the decode worker instead (prefill.fallback: decode_local); a room that
    was reserved for the failed handoff is given back first."""
    with running_gateway(
        tiny_model_path, script, num_prefill=0, extra_prefill_addresses=[_closed_port_address()]
    ) as gw:
        out = gw.openai().completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert out.choices[0].finish_reason == "length" and out.choices[0].text
        (decode,) = gw.decode.decodes
        assert not decode.HasField("state")  # the decode worker computed the prompt itself
        assert gw.decode.aborts == [r.request_id for r in gw.decode.reserves]


def test_an_unreachable_prefill_worker_is_a_503_when_the_fallback_is_fail(tiny_model_path, script):
    with running_gateway(
        tiny_model_path,
        script,
        num_prefill=0,
        extra_prefill_addresses=[_closed_port_address()],
        prefill_fallback="fail",
    ) as gw:
        with pytest.raises(openai.InternalServerError) as caught:
            gw.openai().completions.create(model=MODEL, prompt="hi")
        assert caught.value.status_code == 503
        assert "prefill.fallback is fail" in caught.value.body["message"]
        assert gw.decode.aborts == [r.request_id for r in gw.decode.reserves]
        assert gw.decode.decodes == []


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.INTERNAL, 503),
    ],
)
def test_worker_errors_map_to_http_statuses(tiny_model_path, script, code, status):
    with running_gateway(tiny_model_path, script) as gateway:
        gateway.prefill.fail_with = code
        with gateway.http() as http:
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == status
        _error(response)
        assert gateway.decode.aborts == [gateway.decode.reserves[0].request_id]


def test_token_id_prompts_work_without_a_tokenizer(tmp_path, script):
    with running_gateway(tmp_path, script) as gateway:  # a folder with no tokenizer.json
        result = gateway.openai().completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, logprobs=0)
        assert result.choices[0].finish_reason == "length"
        assert result.choices[0].logprobs.tokens == [f"token_id:{t}" for t in script.token_ids[:3]]
        with pytest.raises(openai.BadRequestError) as caught:
            gateway.openai().completions.create(model=MODEL, prompt="text needs a tokenizer")
        assert "tokenizer" in caught.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            gateway.openai().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        with pytest.raises(openai.BadRequestError):
            gateway.openai().completions.create(model=MODEL, prompt=[5], stop=["x"])


def test_an_exception_in_the_gateway_is_a_500_without_its_text(gateway: Gateway, caplog):
    def broken(num_prompt_tokens: int, max_tokens: int) -> list[str]:
        raise RuntimeError("secret detail at /opt/gateway/router.py")

    gateway.router.rank_decode = broken  # type: ignore[method-assign]
    with gateway.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 500
    message = _error(response)["message"]
    assert "secret" not in message and "RuntimeError" not in message
    error_id = message.rsplit(" ", 1)[-1]
    assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records), "not logged"


def test_an_exception_in_a_worker_is_a_503_without_its_text(gateway: Gateway):
    gateway.prefill.crash_with = RuntimeError("secret detail at /opt/worker/engine.py")
    with gateway.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 503
    error = _error(response)
    assert "secret" not in error["message"] and "UNKNOWN" in error["message"]
    assert gateway.decode.aborts == [gateway.decode.reserves[0].request_id]


def test_a_chat_template_failure_is_a_400_without_the_exception_text(gateway: Gateway):
    body = {"model": MODEL, "messages": [USER_HI], "chat_template_kwargs": {"messages": []}}
    with gateway.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = _error(response)
    assert error["param"] == "messages"
    assert "multiple values" not in error["message"] and "TypeError" not in error["message"]
    _assert_no_worker_touched(gateway)


def test_a_prefill_whose_store_is_unreachable_runs_on_the_decode_worker(tiny_model_path, script):
    """The prefill worker answers but cannot write the state (UNAVAILABLE: its store is down):
    the prompt runs on the decode worker instead of failing, once, and is counted."""
    with running_gateway(tiny_model_path, script) as gw:
        gw.prefill.fail_with = grpc.StatusCode.UNAVAILABLE
        out = gw.openai().completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
        assert len(gw.prefill.requests) == 1  # not tried again on the worker that failed it
        (decode,) = gw.decode.decodes
        assert not decode.HasField("state")
        assert gw.decode.aborts == [r.request_id for r in gw.decode.reserves]
        with gw.http() as http:
            metrics = http.get("/metrics").text
        assert _metric(metrics, "splitserve_prefill_retries_total") == 1
        assert _metric(metrics, "splitserve_prefill_fallbacks_total", policy="decode_local") == 1


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels` (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0
