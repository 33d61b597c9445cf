"""A get that starts before the put finishes streams each chunk as it lands."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from state_store.chunk import Chunk
from state_store.errors import StateReleasedError, StateTimeoutError
from state_store.memory_tier import MemoryTier
from state_store.store import StateStore
from tests.state_store.conftest import make_chunk

WAIT_S = 10.0  # upper bound for a handshake; the test fails (never hangs) if it runs out


class Reader(threading.Thread):
    """Reads a key in the background, signalling after every chunk it receives."""

    def __init__(self, store: StateStore, key: str, **kwargs: object) -> None:
        super().__init__(daemon=True)
        self.store, self.key, self.kwargs = store, key, kwargs
        self.received: list[Chunk] = []
        self.arrived = threading.Semaphore(0)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for chunk in self.store.get(self.key, **self.kwargs):  # type: ignore[arg-type]
                self.received.append(chunk)
                self.arrived.release()
        except BaseException as e:  # inspected by the test thread
            self.error = e


@pytest.fixture
def store() -> Iterator[StateStore]:
    made = StateStore(MemoryTier(1 << 20))
    yield made
    made.close()


def test_each_chunk_reaches_a_waiting_reader_before_the_next_is_put(store: StateStore) -> None:
    chunks = [make_chunk("req", layer) for layer in range(4)]
    store.put(chunks[0], owner="w")  # the key exists; the writer is far from done
    reader = Reader(store, "req")
    reader.start()
    for i, chunk in enumerate(chunks):
        if i:
            store.put(chunk, owner="w")
        assert reader.arrived.acquire(timeout=WAIT_S), f"chunk {i} did not reach the reader"
        assert len(reader.received) == i + 1 and reader.is_alive()
    store.seal("req", owner="w")
    reader.join(WAIT_S)
    assert not reader.is_alive() and reader.error is None
    assert [c.data for c in reader.received] == [c.data for c in chunks]


def test_a_reader_is_told_when_the_key_is_released_mid_stream(store: StateStore) -> None:
    store.put(make_chunk("req", 0), owner="w")
    reader = Reader(store, "req")
    reader.start()
    assert reader.arrived.acquire(timeout=WAIT_S)
    store.release(owner="w")
    reader.join(WAIT_S)
    assert isinstance(reader.error, StateReleasedError)


def test_a_reader_times_out_when_the_writer_never_seals(store: StateStore) -> None:
    store.put(make_chunk("req", 0), owner="w")
    with pytest.raises(StateTimeoutError, match="not sealed in time"):
        list(store.get("req", timeout_s=0.05))


def test_a_cancelled_reader_stops_quietly(store: StateStore) -> None:
    store.put(make_chunk("req", 0), owner="w")
    cancel = threading.Event()
    reader = Reader(store, "req", cancel=cancel)
    reader.start()
    assert reader.arrived.acquire(timeout=WAIT_S)
    cancel.set()
    store.wake("req")
    reader.join(WAIT_S)
    assert not reader.is_alive() and reader.error is None and len(reader.received) == 1
