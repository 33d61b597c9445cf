"""The streaming client reads each response to its end, so one connection serves many requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from frontend.server import GatewayServer
from splitserve.bench.client import stream_request

CHUNK = 'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n'


def _app(client_ports: list[int], linger_s: float) -> FastAPI:
    """Streams two chunks and [DONE]; then keeps the body open for `linger_s` before ending it."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(raw: Request) -> StreamingResponse:
        assert raw.client is not None
        client_ports.append(raw.client.port)

        async def events() -> AsyncIterator[str]:
            yield CHUNK
            yield CHUNK
            yield "data: [DONE]\n\n"
            await asyncio.sleep(linger_s)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def _send_all(url: str, num_requests: int) -> list[float]:
    async with httpx.AsyncClient(timeout=30) as client:
        results = [await stream_request(client, url, {}, "completions") for _ in range(num_requests)]
    assert all(r.success for r in results), [r.error for r in results]
    return [r.end_s - r.send_s for r in results]


def test_sequential_streams_reuse_one_connection() -> None:
    client_ports: list[int] = []
    server = GatewayServer(_app(client_ports, 0.0), "127.0.0.1", 0)
    server.start()
    try:
        asyncio.run(_send_all(f"{server.url}/v1/completions", 5))
    finally:
        server.stop()
    assert len(client_ports) == 5
    assert len(set(client_ports)) == 1


def test_a_stream_kept_open_after_done_ends_at_done_and_does_not_hang() -> None:
    server = GatewayServer(_app([], 30.0), "127.0.0.1", 0)
    server.start()
    try:
        start_s = time.perf_counter()
        (e2e_s,) = asyncio.run(_send_all(f"{server.url}/v1/completions", 1))
        wall_s = time.perf_counter() - start_s
    finally:
        server.stop(timeout_s=5)
    assert e2e_s < 5.0  # measured at [DONE], not when the body ended
    assert wall_s < 15.0  # the drain gave up instead of waiting out the server
