"""Shared helpers for the state-store tests: deterministic chunks and a clock tests can move."""

from __future__ import annotations

import random

import pytest

from state_store import checksum
from state_store.chunk import Chunk, ChunkMeta, StateKind


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
