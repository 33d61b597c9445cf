"""A reader off the store's node pulls arena regions through Mooncake Transfer Engine (TCP).

The store runs in its own process with its arena registered with the engine; this process
writes the state through the arena (as a prefill on the store's node), then reads it as a
reader elsewhere would (`shared_memory=False`, a transport): the bytes cross the engine, each
chunk's checksum is verified, and a damaged or released region fails the read closed.
Skipped where the `mooncake` extra or libibverbs is missing.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.synchronize
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from splitserve.state import checksum
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import CorruptStateError, StateUnavailableError
from splitserve.state.transport import TransportClient, open_client
from state_store.arena import Arena
from state_store.config import StoreConfig
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.state_store.test_shared_memory import _write_layers

WAIT_S = 30.0


def _mooncake_missing() -> str | None:
    from splitserve.state.transport_mooncake import load_engine

    try:
        load_engine()
    except ImportError as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(
    (reason := _mooncake_missing()) is not None, reason=f"mooncake unusable: {reason}"
)


def _serve(
    root: str,
    pool_bytes: int,
    out: multiprocessing.connection.Connection,
    stop: multiprocessing.synchronize.Event,
) -> None:
    store = StateStore(MemoryTier(64 << 20), arena=Arena(root, pool_bytes, transfer_engine="mooncake"))
    server = StateStoreServer(store)
    out.send((server.address, str(store.arena.directory)))  # type: ignore[union-attr]
    stop.wait()
    server.stop(grace_s=0)
    store.close()


@pytest.fixture(scope="module")
def reader() -> TransportClient:
    return open_client("mooncake", "127.0.0.1")  # the engine lives as long as this process


@pytest.fixture(params=[0, 64 << 20], ids=["unlinked-on-free", "pooled"])
def remote_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    stop = context.Event()
    process = context.Process(target=_serve, args=(str(tmp_path / "arenas"), request.param, send, stop))
    process.start()
    try:
        assert receive.poll(WAIT_S), "the store process did not start"
        address, directory = receive.recv()
        yield address, Path(directory)
    finally:
        stop.set()
        process.join(WAIT_S)
        if process.is_alive():
            process.kill()
            process.join()


def _layers() -> list[np.ndarray]:
    return [np.random.default_rng(i).standard_normal(300_000 + i).astype(np.float32) for i in range(3)]


def test_a_remote_reader_pulls_regions_through_the_engine(
    remote_store: tuple[str, Path], reader: TransportClient
) -> None:
    address, _ = remote_store
    layers = _layers()
    with StateStoreClient(address, timeout_s=WAIT_S) as client:
        _write_layers(client, "req", layers, shared_memory=True)
        regions = client.remote_regions(reader)
        assert regions is not None and regions.endpoint.engine == "mooncake"
        chunks = list(client.get("req", timeout_s=WAIT_S, shared_memory=False, transport=reader))
        assert len(chunks) == 3  # one chunk per piece: one engine read each, not cut into messages
        for chunk, expected in zip(chunks, layers, strict=True):
            assert isinstance(chunk.data, memoryview)  # a buffer of this process, filled by the engine
            assert np.array_equal(np.frombuffer(chunk.data, np.float32), expected)


def test_a_damaged_region_fails_the_remote_read_closed(
    remote_store: tuple[str, Path], reader: TransportClient
) -> None:
    address, directory = remote_store
    with StateStoreClient(address, timeout_s=WAIT_S) as client:
        _write_layers(client, "req", [np.ones(1000, dtype=np.float32)], shared_memory=True)
        (region,) = directory.glob("*.region")
        with open(region, "r+b") as f:
            f.write(b"\xff")
        with pytest.raises(CorruptStateError, match="checksum mismatch"):
            list(client.get("req", timeout_s=WAIT_S, shared_memory=False, transport=reader))


def test_a_region_released_meanwhile_fails_closed(
    remote_store: tuple[str, Path], reader: TransportClient
) -> None:
    """The reader learnt the region's address, then the key was released: reading it again gives
    an error (unregistered) or, if the store reused the region for another key, bytes whose
    checksum does not match; never the other key's bytes as this key's."""
    address, _ = remote_store
    with StateStoreClient(address, timeout_s=WAIT_S) as client:
        _write_layers(client, "req", _layers(), shared_memory=True)
        stream = client.get("req", timeout_s=WAIT_S, shared_memory=False, transport=reader)
        first = next(iter(stream))
        stream.cancel()
        regions = client.remote_regions(reader)
        assert regions is not None
        (name,) = {p.name for p in remote_store[1].glob("*.region")}
        regions.read(name, 0, 16)  # the address is cached from here on
        client.release("req")
        _write_layers(
            client, "other", [np.full(900_000, 7.0, dtype=np.float32)], shared_memory=True
        )  # reuses it when pooled
        stale = None
        with contextlib.suppress(StateUnavailableError):  # unregistered: the engine refuses
            stale = regions.read(name, 0, first.meta.num_bytes)
        if stale is not None:  # pooled and rewritten: the old chunk's checksum catches it
            with pytest.raises(CorruptStateError):
                checksum.verify(stale, first.meta.checksum, "a released region")
        with pytest.raises(StateUnavailableError):  # and the key itself is gone
            list(client.get("req", timeout_s=WAIT_S, shared_memory=False, transport=reader))


def test_the_store_actor_serves_its_arena_with_the_configured_engine(reader: TransportClient) -> None:
    """store.transfer_engine reaches the store's server (the deployment's path, run in-process)."""
    from state_store.actor import StateStoreActor

    actor = StateStoreActor(16 << 20, transfer_engine="mooncake")
    try:
        with StateStoreClient(actor.start("127.0.0.1"), timeout_s=WAIT_S) as client:
            regions = client.remote_regions(reader)
            assert regions is not None and regions.endpoint.address.startswith("127.0.0.1:")
            _write_layers(client, "req", [np.arange(1000, dtype=np.float32)], shared_memory=True)
            (chunk,) = client.get("req", timeout_s=WAIT_S, shared_memory=False, transport=reader)
            assert np.array_equal(np.frombuffer(chunk.data, np.float32), np.arange(1000, dtype=np.float32))
    finally:
        actor.shutdown()
    assert StoreConfig().transfer_engine == "none"  # the default: readers elsewhere get bytes over gRPC
