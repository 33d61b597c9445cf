"""Benchmark: the CPU per request the gateway's HTTP protocol (read deadlines, the per-client
connection cap, JSON errors: frontend/http_protocol.py) costs over uvicorn's own h11 protocol.

    python -m experiments.http_protocol_overhead [--num-requests 4000] [--rounds 3]

Each protocol serves the same tiny app (a POST that reads its JSON body and answers a small
JSON) in a child process of its own; this process sends it requests from raw sockets, one at a
time, in two patterns: every request on one kept-alive connection, and a new connection for each
(what `splitserve bench` does). The protocols take turns, round after round, and the table gives
each one's median CPU per request (the child's user + system time, all threads), and the
difference. Figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
from collections.abc import Callable
from multiprocessing.connection import Connection

import uvicorn
from fastapi import FastAPI, Request

from experiments.server_process import ServerProcess, wait_until_told
from frontend.http_protocol import ConnectionLimits, GatewayHTTPConfig
from frontend.server import bind_listening_socket
from frontend.settings import GatewaySettings

BODY = b'{"prompt": "hello there", "max_tokens": 16}'
REQUEST = (
    b"POST /echo HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"num_bytes": len(await request.body())}

    return app


def serve(conn: Connection, protocol: str) -> None:
    """The child: `protocol` is "uvicorn" (its h11 protocol) or "gateway" (ours, default limits)."""
    sock = bind_listening_socket("127.0.0.1", 0)
    if protocol == "gateway":
        limits = ConnectionLimits.of(GatewaySettings.model_validate({}))
        config: uvicorn.Config = GatewayHTTPConfig(_app(), limits, log_level="warning", lifespan="off")
    else:
        config = uvicorn.Config(_app(), http="h11", log_level="warning", lifespan="off")
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        conn.send(f"127.0.0.1:{sock.getsockname()[1]}")
        await asyncio.to_thread(wait_until_told, conn)
        server.should_exit = True
        await task

    asyncio.run(main())


def _read_response(sock: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk


def kept_alive(address: tuple[str, int], num_requests: int) -> None:
    with socket.create_connection(address) as sock:
        for _ in range(num_requests):
            sock.sendall(REQUEST)
            _read_response(sock)


def new_connections(address: tuple[str, int], num_requests: int) -> None:
    for _ in range(num_requests):
        with socket.create_connection(address) as sock:
            sock.sendall(REQUEST)
            _read_response(sock)


def cpu_us_per_request(
    server: ServerProcess, pattern: Callable[[tuple[str, int], int], None], num_requests: int
) -> float:
    host, port = server.address.split(":")
    before = server.cpu_seconds()
    pattern((host, int(port)), num_requests)
    return (server.cpu_seconds() - before) / num_requests * 1e6


def main(argv: list[str] | None = None) -> dict[tuple[str, str], list[float]]:
    """Run the rounds, print the table; the samples, CPU us per request by (protocol, pattern)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=4000, help="per pattern, per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    patterns = {"kept-alive": kept_alive, "new connection": new_connections}
    samples: dict[tuple[str, str], list[float]] = {}
    servers = {name: ServerProcess(serve, (name,), f"http-{name}") for name in ("uvicorn", "gateway")}
    try:
        for server in servers.values():
            server.start()
            for pattern in patterns.values():  # warm up
                pattern((server.address.split(":")[0], int(server.address.split(":")[1])), 200)
        for _ in range(args.rounds):
            for pattern_name, pattern in patterns.items():
                for name, server in servers.items():
                    cost = cpu_us_per_request(server, pattern, args.num_requests)
                    samples.setdefault((name, pattern_name), []).append(cost)
    finally:
        for server in servers.values():
            server.stop()
    print(f"CPU us per request, server process, median of {args.rounds} rounds of {args.num_requests}")
    print(f"{'pattern':>16} | {'uvicorn h11':>11} {'gateway':>9} {'difference':>10}")
    for pattern_name in patterns:
        plain = statistics.median(samples[("uvicorn", pattern_name)])
        ours = statistics.median(samples[("gateway", pattern_name)])
        print(f"{pattern_name:>16} | {plain:11.1f} {ours:9.1f} {ours - plain:+10.1f}")
    return samples


if __name__ == "__main__":
    main()
