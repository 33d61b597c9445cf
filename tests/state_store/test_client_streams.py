"""The client's streaming handles over real gRPC: a Put fed as layers finish, a cancellable Get."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from splitserve.state.chunk import Chunk
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import CorruptStateError, OwnershipError
from state_store.server import StateStoreServer
from tests.state_store.conftest import WAIT_S, make_chunk


def test_an_open_put_streams_each_write_before_it_is_finished(client: StateStoreClient) -> None:
    chunks = [make_chunk("req", layer, size=50_000) for layer in range(3)]
    reading = client.get("req", timeout_s=WAIT_S, wait_for_key=True)
    received = iter(reading)
    put = client.open_put("req", owner="prefill", lease_s=30.0)
    for chunk in chunks:
        put.write([chunk])
        assert next(received).data == chunk.data  # it landed while the put is still open
    assert put.finish(timeout_s=WAIT_S) == (3, 150_000)
    assert list(received) == []  # the seal ended the read
    info = client.lookup("req")
    assert info is not None and info.sealed and info.owner == "prefill"


def test_a_lazy_write_runs_on_the_sending_thread(client: StateStoreClient) -> None:
    threads: list[threading.Thread] = []

    def layer() -> Iterator[Chunk]:
        threads.append(threading.current_thread())
        yield make_chunk("req", 0)

    put = client.open_put("req", owner="w")
    put.write(layer())
    put.finish(timeout_s=WAIT_S)
    assert len(threads) == 1 and threads[0] is not threading.current_thread()


def test_finish_raises_the_stores_error(client: StateStoreClient) -> None:
    client.put([make_chunk("req", 0)], owner="first")
    put = client.open_put("req", owner="second")
    put.write([make_chunk("req", 1)])
    with pytest.raises(OwnershipError, match="belongs to 'first'"):
        put.finish(timeout_s=WAIT_S)


def test_a_cancelled_put_never_seals_and_drops_later_writes(client: StateStoreClient) -> None:
    put = client.open_put("req", owner="w")
    put.write([make_chunk("req", 0)])
    put.cancel()
    put.write([make_chunk("req", 1)])  # the engine may still export a layer: dropped, no error
    info = client.lookup("req")
    assert info is None or (not info.sealed and len(info.chunks) <= 1)


def test_a_get_waiting_for_its_key_can_be_cancelled_from_another_thread(
    server: StateStoreServer, client: StateStoreClient
) -> None:
    stream = client.get("never", timeout_s=60.0, wait_for_key=True)
    received: list[Chunk] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            received.extend(stream)
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stream.cancel()
    reader.join(WAIT_S)
    assert not reader.is_alive() and stream.cancelled
    assert received == [] and errors == []


def test_the_client_verifies_checksums_as_received(
    server: StateStoreServer, client: StateStoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the store serves a chunk whose bytes do not match its checksum."""
    good = make_chunk("req")
    bad = Chunk(good.meta, bytes([good.data[0] ^ 1]) + good.data[1:])
    client.put([good], owner="w", seal=True)
    monkeypatch.setattr(server.store, "read", lambda meta: bad.data)
    with pytest.raises(CorruptStateError, match="layer 0 kda_recurrent chunk 0/1 as received"):
        list(client.get("req"))
