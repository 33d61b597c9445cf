"""Shared helpers for the state-store tests: deterministic chunks, a clock tests can move, and a
real gRPC server with a client on 127.0.0.1."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.state import checksum
from splitserve.state.chunk import Chunk, ChunkMeta, StateKind
from splitserve.state.client import StateStoreClient
from state_store.disk_tier import DiskTier
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.store import StateStore

GRPC_DEFAULT_LIMIT = 4 << 20
WAIT_S = 10.0


class FakeClock:
    """A clock that moves only when told to, so lease tests never sleep."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_chunk(
    key: str = "req-0",
    layer: int = 0,
    index: int = 0,
    num_chunks: int = 1,
    size: int = 1024,
    kind: StateKind = StateKind.KDA_RECURRENT,
) -> Chunk:
    data = random.Random(f"{key}/{layer}/{kind}/{index}").randbytes(size)
    meta = ChunkMeta(key, layer, kind, "uint8", (size,), 0, 64, checksum.compute(data), index, num_chunks)
    return Chunk(meta, data)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[StateStoreServer]:
    store = StateStore(MemoryTier(8 << 20), DiskTier(tmp_path, 64 << 20))
    # Both ends keep gRPC's default 4 MiB limit: any message over it would fail the test.
    served = StateStoreServer(store, "127.0.0.1", 0, max_message_bytes=GRPC_DEFAULT_LIMIT)
    yield served
    served.stop(grace_s=0)
    store.close()


@pytest.fixture
def client(server: StateStoreServer) -> Iterator[StateStoreClient]:
    with StateStoreClient(server.address, max_message_bytes=GRPC_DEFAULT_LIMIT, timeout_s=WAIT_S) as made:
        yield made
