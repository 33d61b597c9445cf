"""Benchmark: what the internal-auth path costs per call, and what the servers' upload window costs.

    python -m experiments.internal_auth_cost [--calls 2000] [--repeats 3] [--upload-mib 256]

Per call: a server in its own process (`ServerProcess`), as a worker's (`rpc.start_server`,
threaded) or the store's (`StateStoreServer`, grpc.aio), holding a cluster token, or none (the
baseline: no interceptor). This process makes `calls` sequential calls of one kind and reports
the client's wall time per call (median of `repeats` rounds) and the server's CPU per call
(its /proc counters over the same round). Kinds:

* `Stats, token held`: a small unary call with the token (what the deployment's own calls pay);
* `Stats, no interceptor`: the same on a server that holds no token (the baseline);
* `Stats, no token`: refused UNAUTHENTICATED at call start, request unread;
* `Health/Check, no token`: answered unread (as if the request were empty);
* `Health/Check, token held`: the full health protocol, request read.

The token check alone: `intercept_service` called `calls` x 10 times in this process for each
case (threaded and grpc.aio), thread CPU per call, best of `repeats`: the decision and the
handler it hands gRPC (the caller's, or the refusal or open answer made per call).

Upload: `upload_mib` MiB streamed client -> server in messages of 1 MiB and of 64 KiB, into a
server with splitserve's options (`rpc.server_options`: BDP probing off, 1 MiB lookahead), with
gRPC's 64 KiB lookahead, and with BDP probing on (gRPC's default); best of `repeats`, GB/s.
Loopback: the link's delay, which is what BDP probing adapts to, is not a real network's.
Figures only: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from concurrent import futures
from multiprocessing.connection import Connection
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from experiments.server_process import ServerProcess, cpu_seconds, wait_until_told
from splitserve import rpc, rpc_auth
from splitserve.v1 import decode_pb2, decode_pb2_grpc, store_pb2, store_pb2_grpc

UPLOAD_SERVICE = "bench.Upload"


class _StatsOnly(decode_pb2_grpc.DecodeServicer):
    def Stats(self, request: Any, context: Any) -> decode_pb2.DecodeStats:  # noqa: N802
        return decode_pb2.DecodeStats(max_num_seqs=8)


def serve_worker(conn: Connection, token: str | None) -> None:
    rpc_auth.set_cluster_token(token)
    register = lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(_StatsOnly(), server)  # noqa: E731
    server, address, _ = rpc.start_server(register, "127.0.0.1", 0)
    conn.send(address)
    wait_until_told(conn)
    server.stop(grace=None).wait(10)


def serve_store(conn: Connection, token: str | None) -> None:
    from state_store.memory_tier import MemoryTier
    from state_store.server import StateStoreServer
    from state_store.store import StateStore

    rpc_auth.set_cluster_token(token)
    store = StateStore(MemoryTier(8 << 20))
    server = StateStoreServer(store, "127.0.0.1", 0)
    conn.send(server.address)
    wait_until_told(conn)
    server.stop()
    store.close()


def serve_upload(conn: Connection, options: list[tuple[str, int]]) -> None:
    """A server whose one method counts the bytes streamed to it."""

    def upload(requests: Any, context: Any) -> bytes:
        return sum(len(r) for r in requests).to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler(
        UPLOAD_SERVICE, {"Upload": grpc.stream_unary_rpc_method_handler(upload)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=options, handlers=[handler])
    port = rpc.bind(server, "127.0.0.1", 0)
    server.start()
    conn.send(f"127.0.0.1:{port}")
    wait_until_told(conn)
    server.stop(grace=None).wait(10)


def _stats_call(channel: grpc.Channel, server_kind: str) -> Callable[..., Any]:
    if server_kind == "worker":
        stats, request = decode_pb2_grpc.DecodeStub(channel).Stats, decode_pb2.DecodeStatsRequest()
    else:
        stats, request = store_pb2_grpc.StateStoreStub(channel).Stats, store_pb2.StatsRequest()
    return lambda **kw: stats(request, **kw)


def _health_call(channel: grpc.Channel) -> Callable[..., Any]:
    check, request = health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest()
    return lambda **kw: check(request, **kw)


def per_call(server_kind: str, num_calls: int, repeats: int) -> dict[str, tuple[float, float]]:
    """{kind: (client µs per call, server CPU µs per call)}, medians over `repeats` rounds."""
    target = serve_worker if server_kind == "worker" else serve_store
    token = rpc_auth.new_cluster_token()
    with_token = [(rpc_auth.TOKEN_METADATA_KEY, token)]
    cases: list[tuple[str, str | None, Callable[[grpc.Channel], Callable[..., Any]], Any]] = [
        ("Stats, token held", token, lambda ch: _stats_call(ch, server_kind), with_token),
        ("Stats, no interceptor", None, lambda ch: _stats_call(ch, server_kind), None),
        ("Stats, no token", token, lambda ch: _stats_call(ch, server_kind), None),
        ("Health/Check, no token", token, _health_call, None),
        ("Health/Check, token held", token, _health_call, with_token),
    ]
    results = {}
    for name, server_token, make_call, metadata in cases:
        with (
            ServerProcess(target, (server_token,), name=f"{server_kind}-server") as server,
            grpc.insecure_channel(server.address) as channel,
        ):
            call = make_call(channel)
            rounds = [_timed_round(call, metadata, num_calls, server.pid) for _ in range(repeats + 1)][1:]
        results[name] = (
            statistics.median(r[0] for r in rounds) * 1e6 / num_calls,
            statistics.median(r[1] for r in rounds) * 1e6 / num_calls,
        )
    return results


def _timed_round(
    call: Callable[..., Any], metadata: Any, num_calls: int, pid: int | None
) -> tuple[float, float]:
    """(wall s, server CPU s) for `num_calls` sequential calls; a refusal counts as a call."""
    cpu_before = cpu_seconds(pid)
    start = time.perf_counter()
    for _ in range(num_calls):
        try:
            call(timeout=30, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise
    return time.perf_counter() - start, cpu_seconds(pid) - cpu_before


class _Details(grpc.HandlerCallDetails):  # type: ignore[misc]
    def __init__(self, method: str, metadata: Any) -> None:
        self.method = method
        self.invocation_metadata = metadata


def interceptor_us(num_calls: int, repeats: int) -> dict[str, tuple[float, float]]:
    """{case: (threaded µs, grpc.aio µs)} for the token check's `intercept_service` alone, in
    this process (thread CPU time, best of `repeats`): the decision and the handler it returns."""
    token = rpc_auth.new_cluster_token()
    handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: None, request_deserializer=health_pb2.HealthCheckRequest.FromString
    )

    other = [("user-agent", "grpc-python/1.85")]  # what a call's metadata holds besides the token
    cases = {
        "Stats, token held": ("/splitserve.v1.Decode/Stats", [*other, (rpc_auth.TOKEN_METADATA_KEY, token)]),
        "Stats, no token": ("/splitserve.v1.Decode/Stats", other),
        "Health/Check, no token": ("/grpc.health.v1.Health/Check", other),
    }
    results = {}
    for name, (method, metadata) in cases.items():
        details = _Details(method, tuple(metadata))
        threaded = functools.partial(
            _intercept_threaded, rpc_auth.TokenCheck(token), details, handler, num_calls
        )
        aio = functools.partial(_run_aio, rpc_auth.AioTokenCheck(token), details, handler, num_calls)
        results[name] = (
            _best_thread_cpu_us(threaded, num_calls, repeats),
            _best_thread_cpu_us(aio, num_calls, repeats),
        )
    return results


def _intercept_threaded(check: Any, details: Any, handler: Any, num_calls: int) -> None:
    for _ in range(num_calls):
        check.intercept_service(lambda _: handler, details)


def _run_aio(check: Any, details: Any, handler: Any, num_calls: int) -> None:
    async def continuation(_: Any) -> Any:
        return handler

    async def calls() -> None:
        for _ in range(num_calls):
            await check.intercept_service(continuation, details)

    asyncio.run(calls())


def _best_thread_cpu_us(run: Callable[[], None], num_calls: int, repeats: int) -> float:
    best_s = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        run()
        best_s = min(best_s, time.thread_time() - start)
    return best_s * 1e6 / num_calls


def upload_gbps(options: list[tuple[str, int]], total_bytes: int, message_bytes: int, repeats: int) -> float:
    with (
        ServerProcess(serve_upload, (options,), name="upload-server") as server,
        grpc.insecure_channel(server.address, options=rpc.channel_options()) as channel,
    ):
        upload = channel.stream_unary(f"/{UPLOAD_SERVICE}/Upload")
        message = bytes(message_bytes)
        best_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            reply = upload(iter([message] * (total_bytes // message_bytes)), timeout=120)
            best_s = min(best_s, time.perf_counter() - start)
            assert int.from_bytes(reply, "little") == total_bytes // message_bytes * message_bytes
    return total_bytes / best_s / 1e9


def upload_options() -> dict[str, list[tuple[str, int]]]:
    ours = rpc.server_options()
    without_lookahead = [kv for kv in ours if kv[0] != "grpc.http2.lookahead_bytes"]
    bdp_on = [kv for kv in without_lookahead if kv[0] != "grpc.http2.bdp_probe"]
    return {
        "splitserve (BDP off, 1 MiB lookahead)": ours,
        "BDP off, gRPC's 64 KiB lookahead": without_lookahead,
        "BDP on (gRPC's default)": bdp_on,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--upload-mib", type=int, default=256)
    args = parser.parse_args(argv)

    print("| token check alone | threaded µs/call | grpc.aio µs/call |")
    print("|---|---|---|")
    for name, (threaded_us, aio_us) in interceptor_us(args.calls * 10, args.repeats).items():
        print(f"| {name} | {threaded_us:.2f} | {aio_us:.2f} |")
    print()
    print("| server | call | client µs/call | server CPU µs/call |")
    print("|---|---|---|---|")
    for server_kind in ("worker", "store"):
        for name, (wall_us, cpu_us) in per_call(server_kind, args.calls, args.repeats).items():
            print(f"| {server_kind} | {name} | {wall_us:.0f} | {cpu_us:.0f} |")
    print()
    print("| server options | 1 MiB messages GB/s | 64 KiB messages GB/s |")
    print("|---|---|---|")
    total = args.upload_mib << 20
    for name, options in upload_options().items():
        rates = [upload_gbps(options, total, size, args.repeats) for size in (1 << 20, 64 << 10)]
        print(f"| {name} | {rates[0]:.2f} | {rates[1]:.2f} |")


if __name__ == "__main__":
    main()
