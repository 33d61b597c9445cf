"""A writer's region leased ahead (`StateStoreClient(spare_region=True)`): the next put copies
into it at once and its first commit moves it to the put's key."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from splitserve.state import StateKind
from splitserve.state.chunk import ChunkMeta
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import InvalidChunkError
from splitserve.state.shm import SPARE_PREFIX
from state_store.arena import Arena
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.state_store.test_shared_memory import write_layers

WAIT_S = 30.0
LAYERS = [np.random.default_rng(i).standard_normal(50_000).astype(np.float32) for i in range(3)]
NUM_BYTES = sum(layer.nbytes for layer in LAYERS)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[StateStoreServer]:
    store = StateStore(MemoryTier(64 << 20), arena=Arena(tmp_path / "arenas", pool_bytes=0))
    served = StateStoreServer(store)
    yield served
    served.stop(grace_s=0)
    store.close()


def _put(client: StateStoreClient, key: str, owner: str = "prefill") -> None:
    put = client.open_put(key, owner=owner, expected_bytes=NUM_BYTES)
    write_layers(put, LAYERS)


def _read(client: StateStoreClient, key: str) -> list[np.ndarray]:
    return [np.frombuffer(chunk.data, np.float32).copy() for chunk in client.get(key, timeout_s=WAIT_S)]


def _spare_keys(store: StateStore) -> list[str]:
    return [key for key in store._entries if key.startswith(SPARE_PREFIX)]


def _wait_for_spare(client: StateStoreClient, store: StateStore) -> str:
    """The spare key once its (unwaited) Allocate has been answered."""
    assert client._spare is not None
    region = client._spare.wait(WAIT_S)
    (key,) = [key for key in _spare_keys(store) if region in store._entries[key].regions]
    return key


def test_the_next_put_writes_into_the_spare_and_takes_it_over(server: StateStoreServer) -> None:
    store = server.store
    with StateStoreClient(server.address, timeout_s=WAIT_S, spare_region=True) as client:
        _put(client, "first")
        spare_key = _wait_for_spare(client, store)
        (spare_region,) = store._entries[spare_key].regions
        _put(client, "second")
        assert spare_region in store._entries["second"].regions  # the spare became the put's region
        assert spare_key not in store._entries
        assert all(np.array_equal(a, b) for a, b in zip(_read(client, "second"), LAYERS, strict=True))
        new_spare = _wait_for_spare(client, store)  # the second put leased the next one
        assert new_spare != spare_key
        # an owner-wide release frees the spare too (it is the writer's)
        assert client.release(owner="prefill").num_keys == 3
        assert not store._entries and not list(store.arena.directory.glob("*.region"))  # type: ignore[union-attr]
        _put(client, "third")  # the forgotten spare is not used: a fresh region
        assert all(np.array_equal(a, b) for a, b in zip(_read(client, "third"), LAYERS, strict=True))


def test_a_spare_is_taken_only_by_its_owner(server: StateStoreServer) -> None:
    store = server.store
    with (
        StateStoreClient(server.address, timeout_s=WAIT_S, spare_region=True) as client,
        StateStoreClient(server.address, timeout_s=WAIT_S) as other,
    ):
        _put(client, "first")
        spare_key = _wait_for_spare(client, store)
        (spare_region,) = store._entries[spare_key].regions
        _put(other, "other", owner="someone-else")  # another writer's put allocates its own
        assert spare_region not in store._entries["other"].regions
        meta = ChunkMeta("thief", 9, StateKind.KDA_RECURRENT, "uint8", (8,), 0, 1, 0)
        store.allocate("thief", owner="someone-else", num_bytes=8)
        with pytest.raises(InvalidChunkError, match="not one of its key's"):
            store.put_region(meta, spare_region, 0, owner="someone-else")
        assert spare_region in store._entries[spare_key].regions
        # a put of another owner through the spare's client gives the spare up and leases its own
        _put(client, "mine", owner="someone-else")
        assert spare_region not in store._entries["mine"].regions
        _wait_for_spare(client, store)  # (the old spare's Release is not waited for)
        while spare_key in store._entries:
            store.expire()
        assert spare_key not in store._spare_regions.values()


def test_an_expired_spare_is_freed_with_its_lease(server: StateStoreServer) -> None:
    store = server.store
    region = store.allocate(f"{SPARE_PREFIX}prefill/x", owner="prefill", num_bytes=4096, lease_s=0.05)
    while store.lookup(f"{SPARE_PREFIX}prefill/x") is not None:  # the real clock runs the lease out
        store.expire()
    assert region not in store._spare_regions
    meta = ChunkMeta("late", 0, StateKind.KDA_RECURRENT, "uint8", (8,), 0, 1, 0)
    store.allocate("late", owner="prefill", num_bytes=8)
    with pytest.raises(InvalidChunkError, match="not one of its key's"):
        store.put_region(meta, region, 0, owner="prefill")


def test_a_put_stream_is_opened_ahead_and_carries_the_next_put(server: StateStoreServer) -> None:
    with StateStoreClient(server.address, timeout_s=WAIT_S, spare_region=True) as client:
        _put(client, "first")
        assert not client._warm_calls.empty()  # opened when the first put finished
        put = client.open_put("second", owner="prefill", expected_bytes=NUM_BYTES)
        assert client._warm_calls.empty()  # taken by this put
        write_layers(put, LAYERS)
        assert all(np.array_equal(a, b) for a, b in zip(_read(client, "second"), LAYERS, strict=True))
        _put(client, "third")
        unused = client._warm_calls.get_nowait()
        client._warm_calls.put(unused)
    assert not unused.usable  # closing the client ended the call nobody used
    assert unused.call.cancelled()


def test_warm_next_opens_the_next_put_stream_without_a_spare_region(server: StateStoreServer) -> None:
    with StateStoreClient(server.address, timeout_s=WAIT_S) as client:
        put = client.open_put("first", owner="prefill", expected_bytes=NUM_BYTES, warm_next=True)
        acked = threading.Event()
        put._call.add_done_callback(lambda _: acked.set())  # runs after the client's own callback
        write_layers(put, LAYERS)
        assert acked.wait(WAIT_S)
        assert not client._warm_calls.empty()  # opened when the store acknowledged the put
        put = client.open_put("second", owner="prefill", expected_bytes=NUM_BYTES)
        assert client._warm_calls.empty()  # taken by this put
        write_layers(put, LAYERS)
        assert client._warm_calls.empty()  # this put did not ask for another
        assert all(np.array_equal(a, b) for a, b in zip(_read(client, "second"), LAYERS, strict=True))
        assert _spare_keys(server.store) == []  # no region was leased ahead


def test_a_cancelled_put_opens_no_call_ahead(server: StateStoreServer) -> None:
    with StateStoreClient(server.address, timeout_s=WAIT_S) as client:
        put = client.open_put("first", owner="prefill", expected_bytes=NUM_BYTES, warm_next=True)
        ended = threading.Event()
        put._call.add_done_callback(lambda _: ended.set())  # runs after the client's own callback
        put.cancel()
        assert ended.wait(WAIT_S)
        assert client._warm_calls.empty()
