"""Disconnects free the workers; health, metrics and the server/actor lifecycle."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from frontend.actor import GatewayActor
from frontend.app import build_app
from frontend.clients import WorkerClients
from frontend.load_monitor import LoadMonitor
from frontend.metrics import GatewayMetrics
from frontend.router import LeastLoadRouter
from frontend.server import GatewayBindError, GatewayServer
from frontend.settings import GatewaySettings
from tests.frontend.conftest import MODEL, Gateway, running_gateway
from tests.frontend.fakes import FakeDecode, FakePrefill, FakeWorkerServer


def _read_two_chunks_then_disconnect(gateway: Gateway, path: str, body: dict) -> list[str]:
    seen = []
    with (
        httpx.Client(base_url=gateway.url, timeout=30) as http,
        http.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen.append(line)
            if len(seen) == 2:
                break
    return seen  # leaving both blocks closes the connection mid-stream


def test_client_disconnect_mid_stream_aborts_the_decode(tiny_model_path, script):
    with running_gateway(tiny_model_path, script) as gateway:
        gateway.decode.hang_after = 2  # streams two tokens, then waits until aborted
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stream": True}
        seen = _read_two_chunks_then_disconnect(gateway, "/v1/completions", body)
        assert len(seen) == 2
        assert gateway.decode.aborted.wait(10), "the gateway never called Decode.Abort"
        assert gateway.decode.aborts == [gateway.decode.reserves[0].request_id]


def _post_raw(gateway: Gateway, path: str, body: dict) -> socket.socket:
    """Send a POST on a bare socket, so the test decides exactly when the client goes away."""
    host, port = gateway.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_client_disconnect_during_a_whole_response_aborts_the_decode(tiny_model_path, script):
    with running_gateway(tiny_model_path, script) as gateway:
        gateway.decode.hang_after = 1
        sock = _post_raw(gateway, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 50})
        assert gateway.decode.started.wait(10)
        sock.close()
        assert gateway.decode.aborted.wait(10), "the gateway never called Decode.Abort"
        assert gateway.decode.aborts == [gateway.decode.reserves[0].request_id]


def test_client_disconnect_during_prefill_aborts_prefill_and_reservation(tiny_model_path, script):
    with running_gateway(tiny_model_path, script) as gateway:
        gateway.prefill.hold = threading.Event()  # the prefill waits until aborted
        body = {"model": MODEL, "prompt": "hi", "stream": True}
        sock = _post_raw(gateway, "/v1/completions", body)
        assert gateway.prefill.arrived.wait(10)
        sock.close()
        assert gateway.prefill.aborted.wait(10), "the gateway never called Prefill.Abort"
        assert gateway.decode.aborted.wait(10), "the reservation was never freed"
        assert gateway.prefill.aborts == gateway.decode.aborts == [gateway.decode.reserves[0].request_id]
        assert gateway.decode.decodes == []


@pytest.mark.parametrize("fallback", ["decode_local", "fail"])
def test_health_needs_a_decode_worker_and_a_way_to_prefill(tiny_model_path, script, fallback):
    with (
        running_gateway(tiny_model_path, script, prefill_fallback=fallback) as gateway,
        gateway.http() as http,
    ):
        response = http.get("/health")
        assert response.status_code == 200
        assert response.json() == {"status": "ok", "prefill_workers": 1, "decode_workers": 1, "problems": []}
        prefill, decode = gateway.router.prefill_addresses, gateway.router.decode_addresses
        gateway.router.update_workers(prefill, [])
        assert http.get("/health").status_code == 503
        gateway.router.update_workers([], decode)
        response = http.get("/health")
        if fallback == "decode_local":  # the decode worker computes prompts: degraded, serving
            assert response.status_code == 200 and response.json()["status"] == "degraded"
        else:
            assert response.status_code == 503 and response.json()["status"] == "no workers"


def _metric_value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in metrics")


def test_metrics_count_ttft_tokens_finish_reasons_and_statuses(gateway: Gateway):
    gateway.openai().completions.create(model=MODEL, prompt="hi", max_tokens=5)
    with gateway.http() as http:
        http.post("/v1/completions", json={"model": MODEL, "prompt": ""})
        response = http.get("/metrics")
    assert response.status_code == 200
    text = response.text
    assert _metric_value(text, "splitserve_time_to_first_token_seconds_count", model_name=MODEL) == 1
    assert _metric_value(text, "splitserve_inter_token_latency_seconds_count", model_name=MODEL) == 4
    assert _metric_value(text, "splitserve_e2e_request_latency_seconds_count", model_name=MODEL) == 1
    assert _metric_value(text, "splitserve_generation_tokens_total", model_name=MODEL) == 5
    assert _metric_value(text, "splitserve_request_success_total", finish_reason="length") == 1
    assert _metric_value(text, "splitserve_queue_time_seconds_count", phase="prefill") == 1
    assert _metric_value(text, "splitserve_queue_time_seconds_count", phase="decode") == 1
    assert _metric_value(text, "splitserve_state_transfer_seconds_sum") == pytest.approx(0.003 + 0.004)
    assert _metric_value(text, "splitserve_state_transfer_bytes_sum") == 4096
    assert _metric_value(text, "splitserve_state_stream_seconds_sum") == pytest.approx(0.005)
    assert (
        _metric_value(text, "splitserve_http_responses_total", route="/v1/completions", status_code="200")
        == 1
    )
    assert (
        _metric_value(text, "splitserve_http_responses_total", route="/v1/completions", status_code="400")
        == 1
    )
    assert _metric_value(text, "splitserve_num_requests_running", model_name=MODEL) == 0
    assert _metric_value(text, "splitserve_num_workers", role="decode") == 1


def test_an_aborted_stream_counts_as_abort(tiny_model_path, script):
    with running_gateway(tiny_model_path, script) as gateway:
        gateway.decode.hang_after = 1
        _read_two_chunks_then_disconnect(
            gateway, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True}
        )
        assert gateway.decode.aborted.wait(10)
        with gateway.http() as http:  # the gateway counts a request before it aborts it on a worker
            text = http.get("/metrics").text
        assert _metric_value(text, "splitserve_request_success_total", finish_reason="abort") == 1


def test_load_monitor_feeds_decode_stats_to_the_router(script):
    full, idle = FakeDecode(script), FakeDecode(script)
    full.stats.num_free_state_slots = 0
    servers = [FakeWorkerServer(full), FakeWorkerServer(idle)]
    router = LeastLoadRouter(["p0"], [s.address for s in servers])
    metrics = GatewayMetrics(MODEL)

    async def refresh_once() -> None:
        clients = WorkerClients(rpc_timeout_s=5)
        try:
            await LoadMonitor(router, clients, metrics, refresh_s=60).refresh()
        finally:
            await clients.close()

    try:
        asyncio.run(refresh_once())
    finally:
        for server in servers:
            server.stop()
    assert (full.num_stats_calls, idle.num_stats_calls) == (1, 1)
    assert router.rank_decode(10, 10) == [servers[1].address, servers[0].address]


def test_load_monitor_stops_routing_to_a_silent_decode_worker(script):
    router = LeastLoadRouter(["p0"], ["127.0.0.1:1"])

    async def refresh_once() -> None:
        clients = WorkerClients(rpc_timeout_s=2)
        try:
            await LoadMonitor(router, clients, GatewayMetrics(MODEL), refresh_s=60).refresh()
        finally:
            await clients.close()

    asyncio.run(refresh_once())
    assert "127.0.0.1:1" in router.unreachable()
    router.update_workers(["p0"], ["127.0.0.1:1", "fresh:1"])
    assert router.rank_decode(1, 1) == ["fresh:1"]  # not even last: it cannot be reached
    router.mark_reachable("127.0.0.1:1")  # the next Stats it answers
    assert sorted(router.rank_decode(1, 1)) == ["127.0.0.1:1", "fresh:1"]


def test_gateway_actor_starts_resizes_reports_and_stops(tiny_model_path, script):
    servers = [FakeWorkerServer(FakePrefill(script)), FakeWorkerServer(FakeDecode(script))]
    settings = GatewaySettings(model_name=MODEL, model_path=str(tiny_model_path), max_model_len=256)
    actor = GatewayActor(settings.model_dump())
    try:
        address = actor.start("127.0.0.1", 0)
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        assert actor.health()["ready"] is False
        with httpx.Client(base_url=f"http://{address}", timeout=30) as http:
            assert http.get("/health").status_code == 503
            actor.update_workers([servers[0].address], [servers[1].address])
            assert actor.health() == {
                "serving": True,
                "address": address,
                "own_address": address,  # one gateway process: its port is its own
                "prefill_workers": 1,
                "decode_workers": 1,
                "ready": True,
            }
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
    finally:
        actor.shutdown()
        for server in servers:
            server.stop()
    assert actor.health()["serving"] is False


def test_a_taken_port_is_one_clear_error_and_leaves_nothing_running():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = GatewayServer(build_app(GatewaySettings(model_name=MODEL)), "127.0.0.1", port)
        with pytest.raises(GatewayBindError, match=rf"127\.0\.0\.1:{port}.*gateway\.port"):
            server.start()
        assert not server.running
        assert not [t for t in threading.enumerate() if t.name == "gateway-uvicorn"]


def test_a_host_that_does_not_resolve_names_gateway_host():
    server = GatewayServer(build_app(GatewaySettings(model_name=MODEL)), "no-such-host.invalid", 0)
    with pytest.raises(GatewayBindError, match="gateway.host"):
        server.start()


def test_gateway_modules_never_import_torch():
    code = (
        "import sys\n"
        "import frontend.app, frontend.actor, frontend.server, frontend.clients, frontend.router\n"
        "from frontend.settings import GatewaySettings\n"
        "frontend.app.build_app(GatewaySettings())\n"
        "bad = [m for m in ('torch', 'transformers', 'splitserve.engine') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
