"""Builds the gRPC servers every worker runs: message limits raised, health service registered."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def start_server(
    register: Callable[[grpc.Server], None], host: str, port: int, max_workers: int = 128
) -> tuple[grpc.Server, str, health.HealthServicer]:
    """Start a server with `register`'s services and grpc.health.v1; returns (server, "host:port", health)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind a gRPC server to {host}:{port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"{host}:{bound}", health_servicer


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """`context.abort`, typed as never returning (it raises to end the RPC)."""
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")
