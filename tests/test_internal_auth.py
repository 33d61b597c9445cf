"""Internal gRPC behind the cluster's shared token: a call without it is refused (UNAUTHENTICATED)
before any servicer runs, a call with it works, on threaded and grpc.aio servers, from threaded
and grpc.aio channels; health checks stay open; the token appears in no log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from frontend.clients import WorkerClients
from frontend.errors import GatewayError
from splitserve import rpc, rpc_auth
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import StateStoreError
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, store_pb2, store_pb2_grpc
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.frontend.fakes import FakeDecode, FakeWorkerServer, Script


@pytest.fixture
def token(caplog: pytest.LogCaptureFixture) -> Iterator[str]:
    """This process holds a fresh cluster token for the test (and none after); every log record
    of the test is checked for it at the end."""
    caplog.set_level(logging.DEBUG)
    secret = rpc_auth.new_cluster_token()
    rpc_auth.set_cluster_token(secret)
    try:
        yield secret
    finally:
        rpc_auth.set_cluster_token(None)
    leaked = [r.getMessage() for r in caplog.records if secret in r.getMessage() or secret in str(r.args)]
    assert not leaked, f"the cluster token was logged: {leaked}"


@pytest.fixture
def decode_server(token: str) -> Iterator[tuple[FakeDecode, str]]:
    fake = FakeDecode(Script([5, 6, 7]))
    register = lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(fake, server)  # noqa: E731
    server, address, _ = rpc.start_server(register, "127.0.0.1", 0)  # as the workers start theirs
    try:
        yield fake, address
    finally:
        server.stop(grace=None).wait(10)


def _bare_channel(address: str) -> grpc.Channel:
    """What an outsider has: a plain channel, no token."""
    return grpc.insecure_channel(address)


def test_a_threaded_server_refuses_calls_without_the_token_and_serves_those_with_it(decode_server) -> None:
    fake, address = decode_server
    with _bare_channel(address) as bare:
        stub = decode_pb2_grpc.DecodeStub(bare)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "cluster token" in refused.value.details()
        request = decode_pb2.DecodeRequest(request_id="r", sampling_params=common_pb2.SamplingParams())
        with pytest.raises(grpc.RpcError) as refused_stream:
            list(stub.Decode(request, timeout=10))
        assert refused_stream.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert rpc.check_health(bare)  # probes need no token
    assert fake.num_stats_calls == 0 and fake.decodes == []  # refused before the servicer ran
    with rpc.make_channel(address) as channel:
        stats = decode_pb2_grpc.DecodeStub(channel).Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
        assert stats.num_total_state_slots == 8
        deltas = list(decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=10))
        assert deltas and deltas[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


def test_a_wrong_token_is_refused(decode_server) -> None:
    _, address = decode_server
    rpc_auth.set_cluster_token(rpc_auth.new_cluster_token())  # another deployment's channel
    try:
        with rpc.make_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            decode_pb2_grpc.DecodeStub(channel).Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        rpc_auth.set_cluster_token(None)


def test_the_gateways_aio_channels_carry_the_token(decode_server, token: str) -> None:
    _, address = decode_server

    async def stats_with(token_held: str | None) -> decode_pb2.DecodeStats:
        rpc_auth.set_cluster_token(token_held)
        clients = WorkerClients(rpc_timeout_s=10)
        try:
            return await clients.decode_stats(address)
        finally:
            await clients.close()

    async def stream_with_token() -> int:
        clients = WorkerClients(rpc_timeout_s=10)
        request = decode_pb2.DecodeRequest(request_id="r", sampling_params=common_pb2.SamplingParams())
        stream = clients.decode(address, request, timeout_s=10)  # a server stream: its own interceptor
        try:
            num_deltas = 0
            while await stream.read() is not None:
                num_deltas += 1
            return num_deltas
        finally:
            await clients.close()

    assert asyncio.run(stats_with(token)).num_total_state_slots == 8
    assert asyncio.run(stream_with_token()) > 0
    with pytest.raises(GatewayError) as refused:
        asyncio.run(stats_with(None))
    assert "UNAUTHENTICATED" in refused.value.message and token not in refused.value.message


def test_the_aio_state_store_refuses_calls_without_the_token(token: str) -> None:
    store = StateStore(MemoryTier(8 << 20))
    server = StateStoreServer(store, "127.0.0.1", 0)
    try:
        with _bare_channel(server.address) as bare:
            stub = store_pb2_grpc.StateStoreStub(bare)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Stats(store_pb2.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as refused_stream:  # a server stream
                list(stub.Get(store_pb2.GetRequest(key="k"), timeout=10))
            assert refused_stream.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as refused_put:  # a client stream
                stub.Put(iter([common_pb2.StateChunk(key="k", data=b"x")]), timeout=10)
            assert refused_put.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert rpc.check_health(bare)
        assert store.stats().num_keys == 0  # the refused Put stored nothing
        with StateStoreClient(server.address, timeout_s=10) as client:
            assert client.stats().num_keys == 0
        rpc_auth.set_cluster_token(None)
        with StateStoreClient(server.address, timeout_s=10) as outsider, pytest.raises(StateStoreError):
            outsider.stats()
    finally:
        server.stop()
        store.close()


def test_without_a_token_servers_and_channels_are_open_as_before() -> None:
    assert rpc_auth.cluster_token() is None
    fake = FakeDecode(Script([5]))
    server = FakeWorkerServer(fake)
    try:
        with _bare_channel(server.address) as bare:
            decode_pb2_grpc.DecodeStub(bare).Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
        assert fake.num_stats_calls == 1
    finally:
        server.stop()


def test_a_caller_with_the_token_is_still_held_to_the_message_limit(token: str) -> None:
    limit_bytes = 1 << 20
    fake = FakeDecode(Script([5]))
    server = rpc.make_server(max_workers=4, max_message_bytes=limit_bytes)
    decode_pb2_grpc.add_DecodeServicer_to_server(fake, server)
    port = rpc.bind(server, "127.0.0.1", 0)
    server.start()
    try:
        with rpc.make_channel(f"127.0.0.1:{port}") as channel:  # sends the token; its own limit is 64 MiB
            stub = decode_pb2_grpc.DecodeStub(channel)
            too_long = decode_pb2.ReserveRequest(request_id="r" * (limit_bytes + 1))
            with pytest.raises(grpc.RpcError) as refused:
                stub.Reserve(too_long, timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert stub.Stats(decode_pb2.DecodeStatsRequest(), timeout=10).num_total_state_slots == 8
        assert fake.reserves == []
    finally:
        server.stop(grace=None).wait(10)


@contextlib.contextmanager
def _server_with_health_only(kind: str) -> Iterator[str]:
    """A threaded server as the workers start theirs, or the grpc.aio store; yields its address."""
    if kind == "threaded":
        server, address, _ = rpc.start_server(lambda _: None, "127.0.0.1", 0)
        try:
            yield address
        finally:
            server.stop(grace=None).wait(10)
        return
    store = StateStore(MemoryTier(8 << 20))
    try:
        with StateStoreServer(store, "127.0.0.1", 0) as store_server:
            yield store_server.address
    finally:
        store.close()


@pytest.mark.parametrize("server_kind", ["threaded", "aio"])
def test_a_tokenless_health_check_is_answered_without_reading_its_request(
    token: str, server_kind: str
) -> None:
    """The open health service answers a caller without the token as if its request were empty
    (the server's own status): the `service` it names is never read. A caller with the token
    gets the full protocol (NOT_FOUND for a service the server does not know)."""
    unknown = health_pb2.HealthCheckRequest(service="no.such.Service")
    with _server_with_health_only(server_kind) as address:
        with _bare_channel(address) as bare:
            health_stub = health_pb2_grpc.HealthStub(bare)
            assert health_stub.Check(unknown, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            watch = health_stub.Watch(unknown, timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        with rpc.make_channel(address) as channel, pytest.raises(grpc.RpcError) as not_found:
            health_pb2_grpc.HealthStub(channel).Check(unknown, timeout=10)
        assert not_found.value.code() == grpc.StatusCode.NOT_FOUND
