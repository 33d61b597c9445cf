"""Failures after the first token: worker crashes, timeouts, and multi-prompt disconnects."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.frontend.conftest import MODEL, running_gateway


def test_decode_crash_mid_stream_sends_an_error_event_then_done(tiny_model_path, script):
    with running_gateway(tiny_model_path, script) as gateway:
        gateway.decode.fail_after = 3
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stream": True}
        with (
            httpx.Client(base_url=gateway.url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "worker_error" and "fake decode worker crashed" in error["message"]
        assert len(events) - 2 == 4  # the first token and three decoded ones arrived before the crash
        assert gateway.decode.aborts == [gateway.decode.reserves[0].request_id]


def test_decode_crash_in_a_whole_response_is_a_503(tiny_model_path, script):
    with running_gateway(tiny_model_path, script) as gateway:
        gateway.decode.fail_after = 2
        with pytest.raises(openai.InternalServerError) as caught:
            gateway.openai().completions.create(model=MODEL, prompt="hi", max_tokens=50)
        assert caught.value.status_code == 503
        assert gateway.decode.aborts == [gateway.decode.reserves[0].request_id]


def test_request_timeout_is_a_503_and_frees_the_decode(tiny_model_path, script):
    with running_gateway(tiny_model_path, script, request_timeout_s=1.0) as gateway:
        gateway.decode.hang_after = 1
        with pytest.raises(openai.InternalServerError) as caught:
            gateway.openai().completions.create(model=MODEL, prompt="hi", max_tokens=50)
        assert caught.value.status_code == 503 and "timed out" in caught.value.body["message"]
        assert gateway.decode.aborted.wait(10)


def test_disconnect_from_a_multi_prompt_stream_aborts_every_decode(tiny_model_path, script):
    with running_gateway(tiny_model_path, script, num_decode=2) as gateway:
        for fake in gateway.decodes:
            fake.hang_after = 1
        body = {"model": MODEL, "prompt": ["one", "two", "three"], "max_tokens": 50, "stream": True}
        with (
            httpx.Client(base_url=gateway.url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 6:  # every prompt's first token and first decoded token
                    break
        for fake in gateway.decodes:
            assert fake.wait_for_aborts(len(fake.reserves))
        aborted = sorted(a for fake in gateway.decodes for a in fake.aborts)
        reserved = sorted(r.request_id for fake in gateway.decodes for r in fake.reserves)
        assert aborted == reserved and len(reserved) == 3
