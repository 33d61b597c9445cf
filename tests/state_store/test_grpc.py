"""The StateStore over real gRPC on 127.0.0.1: multi-MiB state in sub-4-MiB chunks, errors, health."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from splitserve import rpc
from splitserve.state.chunk import MAX_CHUNK_BYTES, Chunk, StateKind, make_chunks
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import (
    CorruptStateError,
    InvalidChunkError,
    OwnershipError,
    StateNotFoundError,
    StateReleasedError,
    StateTimeoutError,
    StateUnavailableError,
)
from splitserve.state.status import status_code
from state_store.server import StateStoreServer
from state_store.servicer import SERVICE_NAME
from tests.state_store.conftest import GRPC_DEFAULT_LIMIT, WAIT_S, make_chunk


def big_state(key: str, num_mib: int = 24) -> tuple[bytes, list[Chunk]]:
    rows, width = num_mib * 256, 1024  # float32 rows of 4 KiB
    data = (bytes(range(251)) * (rows * width * 4 // 251 + 1))[: rows * width * 4]
    chunks = make_chunks(
        key,
        7,
        StateKind.KDA_RECURRENT,
        data,
        dtype="float32",
        shape=(rows, width),
        token_start=0,
        token_end=4096,
    )
    return data, chunks


def test_a_multi_mib_state_round_trips_in_chunks_under_the_default_limit(
    server: StateStoreServer, client: StateStoreClient
) -> None:
    data, chunks = big_state("req")
    assert len(chunks) == 24 and all(len(c.data) < GRPC_DEFAULT_LIMIT for c in chunks)
    assert client.put(chunks, owner="prefill-0", seal=True) == (24, len(data))
    received = list(client.get("req"))
    assert b"".join(c.data for c in received) == data
    assert [c.meta for c in received] == [c.meta for c in chunks]
    stats = client.stats()
    assert stats.num_bytes == len(data) and stats.num_spills > 0  # 24 MiB through an 8 MiB RAM tier
    assert client.release(owner="prefill-0") == (1, len(data))
    assert client.stats().num_bytes == 0


def test_a_remote_get_streams_chunks_before_the_put_finishes(client: StateStoreClient) -> None:
    chunks = [make_chunk("req", layer, size=200_000) for layer in range(3)]
    client.put(chunks[:1], owner="w")
    received: list[Chunk] = []
    arrived = threading.Semaphore(0)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for chunk in client.get("req", timeout_s=WAIT_S):
                received.append(chunk)
                arrived.release()
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert arrived.acquire(timeout=WAIT_S)
    for chunk in chunks[1:]:
        client.put([chunk], owner="w")
        assert arrived.acquire(timeout=WAIT_S)
    client.seal("req", owner="w")
    reader.join(WAIT_S)
    assert not reader.is_alive() and not errors
    assert [c.data for c in received] == [c.data for c in chunks]


def test_store_errors_arrive_as_the_same_exception_types(client: StateStoreClient) -> None:
    with pytest.raises(StateNotFoundError, match="no state under key 'nope'"):
        list(client.get("nope"))
    good = make_chunk("req")
    bad = Chunk(good.meta, bytes([good.data[0] ^ 1]) + good.data[1:])
    with pytest.raises(CorruptStateError, match="checksum mismatch"):
        client.put([bad], owner="w")
    client.put([good], owner="w")
    with pytest.raises(OwnershipError, match="belongs to 'w'"):
        client.put([make_chunk("req", 1)], owner="x")
    with pytest.raises(StateTimeoutError, match="not sealed"):
        list(client.get("req", timeout_s=0.05))
    client.release(key="req")
    with pytest.raises(StateReleasedError, match="released by key"):
        list(client.get("req"))


def test_chunks_over_the_store_limit_are_refused(client: StateStoreClient) -> None:
    with pytest.raises(InvalidChunkError, match="split it with splitserve.state.make_chunks"):
        client.put([make_chunk("req", size=MAX_CHUNK_BYTES + 1)], owner="w")


def test_lookup_prefixes_renew_over_the_wire(client: StateStoreClient) -> None:
    client.put([make_chunk("req", 0), make_chunk("req", 1)], owner="w", seal=True, lease_s=5.0)
    info = client.lookup("req")
    assert info is not None
    assert (info.owner, info.sealed, info.num_layers, len(info.chunks)) == ("w", True, 2, 2)
    assert 0 < info.lease_remaining_s <= 5.0
    assert client.lookup("other") is None
    client.register([b"a", b"b"], "req")
    assert client.longest_match([b"a", b"b", b"c"]) == (2, "req")
    assert client.longest_match([b"z"]) == (0, None)
    client.renew("req", 120.0)
    renewed = client.lookup("req")
    assert renewed is not None and renewed.lease_remaining_s > 100.0


def test_the_server_answers_health_checks_and_picks_a_free_port(server: StateStoreServer) -> None:
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    channel = rpc.make_channel(server.address)
    try:
        rpc.wait_ready(channel, WAIT_S, server.address)
        assert rpc.check_health(channel) and rpc.check_health(channel, SERVICE_NAME)
    finally:
        channel.close()


def test_binding_a_port_in_use_fails_clearly(server: StateStoreServer) -> None:
    other = rpc.make_server()
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{server.port}; is the port in use"):
            rpc.bind(other, "127.0.0.1", server.port)
    finally:
        other.stop(None)


def test_an_unreachable_store_raises_unavailable() -> None:
    with socket.socket() as probe:  # a port nothing listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = StateStoreClient(f"127.0.0.1:{port}", timeout_s=WAIT_S)
    try:
        with pytest.raises(StateUnavailableError, match="UNAVAILABLE") as err:
            client.stats()
        assert status_code(err.value) == grpc.StatusCode.UNAVAILABLE  # passed on, it keeps its status
    finally:
        client.close()


def test_a_call_on_a_closed_client_is_a_store_error_not_a_grpc_value_error(
    server: StateStoreServer,
) -> None:
    """A worker's timer may release a key after the worker closed its client at shutdown."""
    client = StateStoreClient(server.address, timeout_s=WAIT_S)
    client.close()
    with pytest.raises(StateUnavailableError, match="is closed"):
        client.release("some-key")
