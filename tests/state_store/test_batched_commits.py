"""Pieces committed through the arena travel in few messages, and a piece written alone still
streams at once (a decode scatters each layer as it lands)."""

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
