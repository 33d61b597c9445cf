"""A get that starts before the put finishes streams each chunk as it lands."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from splitserve.state.chunk import Chunk
from splitserve.state.errors import StateNotFoundError, StateReleasedError, StateTimeoutError
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


def _signal_when_a_reader_waits_for_the_key(store: StateStore) -> threading.Event:
    """Set once a reader blocks waiting for a key's first put (so the test orders put after it)."""
    waiting = threading.Event()
    condition = store._key_created
    wait = condition.wait

    def signalling_wait(timeout: float | None = None) -> bool:
        waiting.set()
        return wait(timeout)

    condition.wait = signalling_wait  # type: ignore[method-assign]
    return waiting


def test_a_reader_that_starts_before_the_first_put_waits_for_the_key(store: StateStore) -> None:
    waiting = _signal_when_a_reader_waits_for_the_key(store)
    reader = Reader(store, "req", wait_for_key=True)
    reader.start()
    assert waiting.wait(WAIT_S), "the reader never waited for the key"
    chunks = [make_chunk("req", layer) for layer in range(3)]
    for chunk in chunks:
        store.put(chunk, owner="w")
    store.seal("req", owner="w")
    reader.join(WAIT_S)
    assert not reader.is_alive() and reader.error is None
    assert [c.data for c in reader.received] == [c.data for c in chunks]


def test_without_wait_for_key_an_unknown_key_is_not_found_at_once(store: StateStore) -> None:
    with pytest.raises(StateNotFoundError):
        list(store.get("nobody-wrote-this"))


def test_waiting_for_a_key_that_never_comes_times_out(store: StateStore) -> None:
    with pytest.raises(StateTimeoutError, match="nothing was put under key"):
        list(store.get("req", timeout_s=0.05, wait_for_key=True))


def test_waiting_for_a_key_already_released_fails_at_once_with_why(store: StateStore) -> None:
    store.put(make_chunk("req", 0), owner="w")
    store.release("req")
    with pytest.raises(StateReleasedError):
        list(store.get("req", wait_for_key=True))  # no timeout: it must not wait


def test_a_reader_waiting_for_the_key_stops_quietly_when_cancelled(store: StateStore) -> None:
    waiting = _signal_when_a_reader_waits_for_the_key(store)
    cancel = threading.Event()
    reader = Reader(store, "req", wait_for_key=True, cancel=cancel)
    reader.start()
    assert waiting.wait(WAIT_S)
    cancel.set()
    store.wake("req")
    reader.join(WAIT_S)
    assert not reader.is_alive() and reader.error is None and reader.received == []


def test_a_reader_waiting_for_a_key_released_before_any_write_is_told(store: StateStore) -> None:
    # a writer that failed before storing anything frees its key: the reader must not wait it out
    waiting = _signal_when_a_reader_waits_for_the_key(store)
    reader = Reader(store, "req", wait_for_key=True)  # no timeout: only the release can end it
    reader.start()
    assert waiting.wait(WAIT_S)
    assert store.release("req").num_keys == 0  # nothing was stored under it
    reader.join(WAIT_S)
    assert not reader.is_alive() and isinstance(reader.error, StateReleasedError)
    with pytest.raises(StateReleasedError, match="never written again"):
        store.put(make_chunk("req", 0), owner="w")  # a late write is refused
