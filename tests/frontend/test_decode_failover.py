"""Decode failover at the gateway, against fake workers: a decode worker's server stops mid-stream
and the request resumes on another one, re-prefilled from prompt + the tokens already sent."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.frontend.conftest import MODEL, SCRIPT_TEXT, Gateway, running_gateway
from tests.frontend.fakes import FakeDecode, FakeWorkerServer

NUM_BEFORE_LOSS = 3  # decoded tokens the lost worker streams before it goes
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 200}


@dataclass
class Doomed:
    """A decode worker that streams NUM_BEFORE_LOSS tokens, then hangs until its server stops."""

    fake: FakeDecode
    server: FakeWorkerServer
    healthy_address: str  # the gateway's own decode fake (`gateway.decode`), to fail over to


@contextlib.contextmanager
def gateway_with_doomed_decode(tiny_model_path, script, **settings) -> Iterator[tuple[Gateway, Doomed]]:
    """The router knows only the doomed worker until the test calls `lose()`: every request
    starts there, and the healthy worker (`gateway.decode`) is what it can fail over to."""
    doomed_fake = FakeDecode(script, hang_after=NUM_BEFORE_LOSS)
    server = FakeWorkerServer(doomed_fake)
    try:
        with running_gateway(tiny_model_path, script, **settings) as gateway:
            healthy_address = gateway.router.decode_addresses[0]
            gateway.router.update_workers(gateway.router.prefill_addresses, [server.address])
            yield gateway, Doomed(doomed_fake, server, healthy_address)
    finally:
        server.stop()


def lose(gateway: Gateway, doomed: Doomed) -> None:
    """The doomed worker's server stops; the healthy one joins the pool (the dead one is still
    listed, ahead of it, as it is until the controller's next health pass: failover gets past it)."""
    doomed.server.stop()
    addresses = [doomed.server.address, doomed.healthy_address]
    gateway.router.update_workers(gateway.router.prefill_addresses, addresses)


def stream_with_loss(gateway: Gateway, doomed: Doomed, body: dict) -> list[str]:
    """Every SSE data payload; the doomed worker is lost once the client has seen its tokens."""
    events: list[str] = []
    with (
        httpx.Client(base_url=gateway.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1 + NUM_BEFORE_LOSS:  # the first token and everything it decoded
                    lose(gateway, doomed)
    return events


def _text(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]" and "error" not in e)


@pytest.fixture
def healthy(tiny_model_path, script):
    with gateway_with_doomed_decode(tiny_model_path, script) as (gateway, doomed):
        yield gateway, doomed


def test_a_lost_stream_resumes_elsewhere_with_no_token_repeated_or_missing(healthy, script):
    gateway, doomed = healthy
    events = stream_with_loss(gateway, doomed, BODY)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events)
    assert _text(events) == SCRIPT_TEXT
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] == "stop" and finish.count("stop") == 1

    sent = script.token_ids[: 1 + NUM_BEFORE_LOSS]
    resumed_prefill = gateway.prefill.requests[-1]
    assert list(resumed_prefill.output_token_ids) == sent
    reserve = gateway.decode.reserves[-1]
    assert reserve.num_prompt_tokens == len(resumed_prefill.prompt_token_ids) + len(sent)
    decode = gateway.decode.decodes[-1]
    assert list(decode.output_token_ids) == sent and decode.first_token_id == script.token_ids[len(sent)]

    metrics = httpx.get(f"{gateway.url}/metrics").text
    resumed = 'splitserve_decode_failovers_total{method="reprefill",model_name="tiny-kimi",outcome="resumed"}'
    assert f"{resumed} 1.0" in metrics


def test_a_whole_response_survives_the_loss_too(healthy, script):
    gateway, doomed = healthy
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        client = gateway.openai()
        future = pool.submit(lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=200))
        # Wherever in the doomed stream the loss lands, the resumed output is the same.
        assert doomed.fake.started.wait(10)
        lose(gateway, doomed)
        assert future.result(30).choices[0].text == SCRIPT_TEXT


def test_with_failover_off_the_stream_ends_with_an_error_event(tiny_model_path, script):
    with gateway_with_doomed_decode(tiny_model_path, script, decode_failover=False) as (gateway, doomed):
        events = stream_with_loss(gateway, doomed, BODY)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "decode_worker_lost" and error["type"] == "service_unavailable_error"
        assert "decode.failover is off" in error["message"]
        assert len(events) - 2 == 1 + NUM_BEFORE_LOSS
        assert not gateway.decode.reserves  # nothing was resumed
        metrics = httpx.get(f"{gateway.url}/metrics").text
        assert 'outcome="disabled"} 1.0' in metrics


def test_failovers_are_bounded(tiny_model_path, script):
    with gateway_with_doomed_decode(tiny_model_path, script, max_decode_failovers=0) as (gateway, doomed):
        events = stream_with_loss(gateway, doomed, BODY)
        error = json.loads(events[-2])["error"]
        assert (
            error["code"] == "decode_worker_lost" and "gave up after losing 0 decode workers" in error["message"]
        )


def _failed_tries(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("splitserve_decode_failovers_total{") and 'outcome="failed"' in line
    )


def _stream_losing_the_only_worker(gateway: Gateway, doomed: Doomed, lost) -> list[str]:
    """Like `stream_with_loss`, but the lost worker stays the only one listed; `lost()` runs once
    it is gone (on the streaming thread's side, while the gateway looks for another)."""
    events: list[str] = []
    with (
        httpx.Client(base_url=gateway.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1 + NUM_BEFORE_LOSS:
                    doomed.server.stop()
                    lost()
    return events


def test_a_lost_stream_waits_for_a_decode_worker_to_come_back(tiny_model_path, script):
    """The only decode worker dies: the stream waits (trying again with a backoff) until a worker
    is there to resume on, as when the controller restarts the only one, and goes on exactly."""
    with gateway_with_doomed_decode(tiny_model_path, script) as (gateway, doomed):
        pool = concurrent.futures.ThreadPoolExecutor(1)

        def come_back() -> None:
            def later() -> None:
                deadline = time.monotonic() + 30
                while doomed.server.address not in gateway.router.unreachable():  # found it gone
                    assert time.monotonic() < deadline, "the gateway never found the worker gone"
                    time.sleep(0.02)
                gateway.router.update_workers(gateway.router.prefill_addresses, [doomed.healthy_address])

            pool.submit(later)

        events = _stream_losing_the_only_worker(gateway, doomed, come_back)
        pool.shutdown()
        assert events[-1] == "[DONE]" and not any("error" in e for e in events), events[-3:]
        assert _text(events) == SCRIPT_TEXT


def test_a_lost_stream_gives_up_after_the_failover_wait(tiny_model_path, script):
    with gateway_with_doomed_decode(tiny_model_path, script, decode_failover_wait_s=0.5) as (gateway, doomed):
        events = _stream_losing_the_only_worker(gateway, doomed, lambda: None)
        error = json.loads(events[-2])["error"]
        assert error["code"] == "decode_worker_lost", error
        assert "no decode worker took the request within 0.5 s" in error["message"], error
