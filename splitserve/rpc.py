"""Shared gRPC plumbing for every splitserve server and client. Torch-free.

One place decides the message limits, how a server binds (port 0 picks a free port and the real
one comes back), that every server answers the standard `grpc.health.v1` health checks, and how
channels are opened. Servers and channels made here carry the cluster's shared token once the
process holds one (`splitserve.rpc_auth`): servers refuse calls without it, channels send it. State chunks stay under gRPC's 4 MiB default regardless of these limits
(splitserve.state.MAX_CHUNK_BYTES), so they also pass peers that keep the default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent import futures
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve import rpc_auth

MAX_MESSAGE_BYTES = 64 << 20  # large prompts' token ids; state never comes near it
DEFAULT_MAX_WORKERS = 64  # streaming Gets park a thread each while they wait for state
WORKER_MAX_THREADS = 128  # each in-flight Prefill or Decode stream parks one thread

Options = list[tuple[str, int]]


def message_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> Options:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# Clients ping a quiet connection this often, calls or not, to notice a dead peer on an idle stream.
KEEPALIVE_TIME_MS = 30_000
# Servers accept a ping every half keepalive interval, calls or not. gRPC's default policy (one
# ping per 5 min, none without calls) counts our clients' pings as abuse and, after
# MAX_PING_STRIKES of them, closes the connection with GOAWAY too_many_pings.
MIN_RECV_PING_INTERVAL_MS = KEEPALIVE_TIME_MS // 2
MAX_PING_STRIKES = 2  # gRPC's default, kept: a peer pinging faster than the policy is still cut off
# A channel whose peer went away retries with exponential backoff, by default up to 120 s: a worker
# or store restarted at the same address in seconds stayed unreachable through a cached channel for
# minutes (seen: a decode reading a restarted store failed fast with UNAVAILABLE). Capped here.
MAX_RECONNECT_BACKOFF_MS = 2_000


# What a server's transport takes in on a call before its handler asks for a message. gRPC's BDP
# probing grows that window with the link's bandwidth x delay, so a call whose handler had not
# run yet (a busy pool; a refusal waiting its turn, splitserve.rpc_auth) was taken in, up to
# whole: 16 tokenless 58 MB calls to a server whose 2 threads were busy, +128-257 MiB on loopback,
# +935 MiB (all of it) behind a relaying proxy. With the probe off the window stays at the
# lookahead until the handler reads (+16 MiB); a read still opens it to the message's size.
# 1 MiB, not gRPC's 64 KiB: at 64 KiB, 64 KiB messages uploaded at 0.4-0.7x the rate (PERFORMANCE.md 15).
SERVER_LOOKAHEAD_BYTES = 1 << 20


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> Options:
    return [
        *message_options(max_message_bytes),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", SERVER_LOOKAHEAD_BYTES),
        ("grpc.so_reuseport", 0),  # SO_REUSEPORT would let two servers share a port and split traffic
        ("grpc.keepalive_permit_without_calls", 1),
        # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; an unknown key is silently ignored
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> Options:
    return [
        *message_options(max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # default 2 would stop pinging a quiet stream
        ("grpc.initial_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS // 10),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


def make_server(
    max_workers: int = DEFAULT_MAX_WORKERS, max_message_bytes: int = MAX_MESSAGE_BYTES
) -> grpc.Server:
    """A not-yet-started synchronous server with splitserve's options."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=server_options(max_message_bytes),
        interceptors=server_interceptors(),
    )


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """The token check for a threaded server, when this process holds the cluster token."""
    token = rpc_auth.cluster_token()
    return [rpc_auth.TokenCheck(token)] if token else []


def aio_server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The token check for a grpc.aio server, when this process holds the cluster token."""
    token = rpc_auth.cluster_token()
    return [rpc_auth.AioTokenCheck(token)] if token else []


def format_address(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Binds an insecure port (0 = any free one); returns the port bound. Call before `start`."""
    address = format_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:  # grpcio >= 1.5x raises; older versions returned 0
        raise OSError(f"could not bind a gRPC server to {address}; is the port in use?") from e
    if bound == 0:
        raise OSError(f"could not bind a gRPC server to {address}; is the port in use?")
    return bound


def add_health(server: grpc.Server, service_names: Iterable[str] = ()) -> health.HealthServicer:
    """Registers `grpc.health.v1.Health`, SERVING for the server ("") and each named service.

    Call `health.enter_graceful_shutdown()` on the result before stopping the server, so load
    balancers stop sending work first.
    """
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *service_names):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


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


def make_channel(address: str, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    """An insecure channel to "host:port" with splitserve's options (connects lazily); its calls
    carry the cluster token when this process holds one."""
    channel = grpc.insecure_channel(address, options=channel_options(max_message_bytes))
    token = rpc_auth.cluster_token()
    return grpc.intercept_channel(channel, rpc_auth.TokenSender(token)) if token else channel


def make_aio_channel(address: str, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """`make_channel` for grpc.aio (create it on the event loop that uses it)."""
    token = rpc_auth.cluster_token()
    interceptors = rpc_auth.aio_token_senders(token) if token else None
    return grpc.aio.insecure_channel(
        address, options=channel_options(max_message_bytes), interceptors=interceptors
    )


def wait_ready(channel: grpc.Channel, timeout_s: float, address: str = "the server") -> None:
    """Blocks until `channel` connects; raises TimeoutError naming `address` if it does not."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError as e:
        raise TimeoutError(f"could not connect to {address} within {timeout_s} s; is it running?") from e


def check_health(channel: grpc.Channel, service: str = "", timeout_s: float = 5.0) -> bool:
    """True if the server on `channel` reports `service` SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return reply.status == health_pb2.HealthCheckResponse.SERVING
