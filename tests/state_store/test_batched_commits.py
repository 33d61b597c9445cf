"""Pieces committed through the arena travel in few messages, and a piece written alone still
streams at once (a decode scatters each layer as it lands); with `hold_bytes`, small pieces wait
on the writer's side and go together."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from splitserve.state.client import StateStoreClient
from splitserve.state.shm import SlabWriter
from splitserve.v1 import store_pb2
from state_store.arena import Arena
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.servicer import StateStoreServicer
from state_store.store import StateStore
from tests.state_store.test_shared_memory import write_piece

WAIT_S = 30.0


@pytest.fixture
def batch_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Chunks per PutBatch message the servicer receives (recorded before it stores them)."""
    sizes: list[int] = []
    put_batch = StateStoreServicer.PutBatch

    async def recording(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async def batches() -> AsyncIterator[store_pb2.StateChunks]:
            async for batch in request_iterator:
                sizes.append(len(batch.chunks))
                yield batch

        return await put_batch(self, batches(), context)

    monkeypatch.setattr(StateStoreServicer, "PutBatch", recording)
    return sizes


@pytest.fixture
def client(tmp_path: Path, batch_sizes: list[int]) -> Iterator[StateStoreClient]:
    store = StateStore(MemoryTier(64 << 20), arena=Arena(tmp_path / "arenas", pool_bytes=0))
    server = StateStoreServer(store)
    with StateStoreClient(server.address, timeout_s=WAIT_S) as client:
        yield client
    server.stop(grace_s=0)
    store.close()


def _piece(layer: int) -> np.ndarray:
    return np.full(1024, layer, dtype=np.float32)


def _write(put, layer: int) -> None:  # type: ignore[no-untyped-def]
    write_piece(put, layer, _piece(layer))


def test_a_backlog_of_pieces_goes_in_one_message(
    client: StateStoreClient, batch_sizes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = threading.Event()
    place = SlabWriter.place

    def held_place(self, *args):  # type: ignore[no-untyped-def]
        queued.wait(WAIT_S)  # the sending thread copies the first piece only once all are queued
        return place(self, *args)

    monkeypatch.setattr(SlabWriter, "place", held_place)
    put = client.open_put("req", owner="prefill", shared_memory=True)
    for layer in range(64):
        _write(put, layer)
    queued.set()
    assert put.finish(timeout_s=WAIT_S) == (64, 64 * 4096)
    # 64 commits and the seal; the seal may follow alone (finish is called after the backlog went)
    assert sum(batch_sizes) == 65 and len(batch_sizes) <= 2
    chunks = list(client.get("req", timeout_s=WAIT_S))
    assert [c.meta.layer for c in chunks] == list(range(64))
    assert all(np.array_equal(np.frombuffer(c.data, np.float32), _piece(c.meta.layer)) for c in chunks)


def test_a_piece_written_alone_reaches_the_reader_before_the_next(client: StateStoreClient) -> None:
    stream = iter(client.get("req", timeout_s=WAIT_S, wait_for_key=True))
    put = client.open_put("req", owner="prefill", shared_memory=True)
    for layer in range(3):
        _write(put, layer)
        chunk = next(stream)  # the store's timeout fails this if the writer held the piece back
        assert chunk.meta.layer == layer and np.array_equal(
            np.frombuffer(chunk.data, np.float32), _piece(layer)
        )
    put.finish(timeout_s=WAIT_S)
    assert list(stream) == []


def test_small_pieces_held_go_in_one_message_with_the_seal(
    client: StateStoreClient, batch_sizes: list[int]
) -> None:
    put = client.open_put("req", owner="prefill", shared_memory=True, hold_bytes=1 << 20)
    for layer in range(6):  # 6 x 4 KiB: all held (the sending thread never sees one alone)
        _write(put, layer)
    assert batch_sizes == []
    assert put.finish(timeout_s=WAIT_S) == (6, 6 * 4096)
    assert batch_sizes == [7]  # six commits and the seal
    chunks = list(client.get("req", timeout_s=WAIT_S))
    assert [c.meta.layer for c in chunks] == list(range(6))
    assert all(np.array_equal(np.frombuffer(c.data, np.float32), _piece(c.meta.layer)) for c in chunks)


def test_held_pieces_go_once_they_reach_hold_bytes(client: StateStoreClient) -> None:
    stream = iter(client.get("req", timeout_s=WAIT_S, wait_for_key=True))
    put = client.open_put("req", owner="prefill", shared_memory=True, hold_bytes=2 * 4096)
    _write(put, 0)  # held: 4 KiB of 8
    _write(put, 1)  # 8 KiB held: both go, and the reader gets them before any more is written
    assert [next(stream).meta.layer for _ in range(2)] == [0, 1]
    _write(put, 2)  # held until the seal
    put.finish(timeout_s=WAIT_S)
    assert [c.meta.layer for c in stream] == [2]


def test_cancelling_drops_held_pieces(client: StateStoreClient, batch_sizes: list[int]) -> None:
    put = client.open_put("req", owner="prefill", shared_memory=True, hold_bytes=1 << 20)
    _write(put, 0)
    put.cancel()
    _write(put, 1)  # after cancel: dropped
    assert client.lookup("req") is None
    assert sum(batch_sizes) == 0
