"""Start-a-worker-server in one call, on top of `splitserve.rpc`'s options, binding and health."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import grpc
from grpc_health.v1 import health

from splitserve.rpc import add_health, bind, format_address, make_server

WORKER_MAX_THREADS = 128  # each in-flight Prefill or Decode stream parks one thread


def start_server(
    register: Callable[[grpc.Server], None], host: str, port: int, max_workers: int = WORKER_MAX_THREADS
) -> tuple[grpc.Server, str, health.HealthServicer]:
    """Start a server with `register`'s services and grpc.health.v1; returns (server, "host:port", health)."""
    server = make_server(max_workers=max_workers)
    register(server)
    health_servicer = add_health(server)
    bound = bind(server, host, port)
    server.start()
    return server, format_address(host, bound), health_servicer


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """`context.abort`, typed as never returning (it raises to end the RPC)."""
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")
