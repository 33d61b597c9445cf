"""Stopping the gateway drains it: new requests get 503, /health says draining, and requests
already in flight finish (or are cut once `drain_timeout_s` has passed)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from frontend.actor import GatewayActor
from frontend.settings import GatewaySettings
from tests.frontend.conftest import MODEL
from tests.frontend.fakes import FakeDecode, FakePrefill, FakeWorkerServer

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


@pytest.fixture
def held_gateway(tiny_model_path, script) -> Iterator[tuple[GatewayActor, FakePrefill, str]]:
    """A real gateway actor whose prefill worker holds every request until released."""
    prefill = FakePrefill(script, hold=threading.Event())
    servers = [FakeWorkerServer(prefill), FakeWorkerServer(FakeDecode(script))]
    settings = GatewaySettings(model_name=MODEL, model_path=str(tiny_model_path), max_model_len=256)
    actor = GatewayActor(settings, [servers[0].address], [servers[1].address])
    try:
        url = f"http://{actor.start('127.0.0.1', 0)}"
        yield actor, prefill, url
    finally:
        assert prefill.hold is not None
        prefill.hold.set()
        actor.shutdown(drain_timeout_s=0)
        for server in servers:
            server.stop()


def _send_one_held_request(pool: ThreadPoolExecutor, url: str, prefill: FakePrefill) -> Future:
    in_flight = pool.submit(httpx.post, f"{url}/v1/completions", json=BODY, timeout=60)
    assert prefill.arrived.wait(30), "the request never reached the prefill worker"
    return in_flight


def _wait_until_closed(actor: GatewayActor, shutdown: Future) -> None:
    closed = threading.Event()
    poll = threading.Thread(target=lambda: _poll_closed(actor, closed, shutdown), daemon=True)
    poll.start()
    assert closed.wait(30), "shutdown never closed admission"


def _poll_closed(actor: GatewayActor, closed: threading.Event, shutdown: Future) -> None:
    while actor.app.state.admission.is_open and not shutdown.done():
        threading.Event().wait(0.005)
    closed.set()


def test_stop_refuses_new_requests_and_lets_the_one_in_flight_finish(held_gateway):
    actor, prefill, url = held_gateway
    with ThreadPoolExecutor(2) as pool:
        in_flight = _send_one_held_request(pool, url, prefill)
        shutdown = pool.submit(actor.shutdown, 30)
        _wait_until_closed(actor, shutdown)

        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert not shutdown.done(), "shutdown returned with a request still in flight"

        assert prefill.hold is not None
        prefill.hold.set()
        finished = in_flight.result(timeout=60)
        assert finished.status_code == 200, finished.text
        assert finished.json()["choices"][0]["finish_reason"] == "length"
        assert shutdown.result(timeout=60) == 0
    assert actor.health()["serving"] is False


def test_a_request_still_running_at_the_drain_deadline_is_cut(held_gateway):
    actor, prefill, url = held_gateway
    with ThreadPoolExecutor(1) as pool:
        in_flight = _send_one_held_request(pool, url, prefill)
        assert actor.shutdown(drain_timeout_s=0.2) == 1
        assert actor.health()["serving"] is False
        assert prefill.hold is not None
        prefill.hold.set()
        with pytest.raises(httpx.HTTPError):
            in_flight.result(timeout=60).raise_for_status()
