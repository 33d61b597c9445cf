"""The same-node path: pieces copied once into the store's arena, read back as zero-copy views."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from splitserve.state import StateKind
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import CorruptStateError
from splitserve.state.streams import PutStream
from state_store.arena import Arena
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.store import StateStore

WAIT_S = 30.0


@pytest.fixture
def arena_root(tmp_path: Path) -> Path:
    return tmp_path / "arenas"  # tmpfs or not, the protocol is the same; each test gets its own root


@pytest.fixture
def shm_server(arena_root: Path) -> Iterator[StateStoreServer]:
    store = StateStore(MemoryTier(64 << 20), arena=Arena(arena_root, pool_bytes=0))  # freed = unlinked
    served = StateStoreServer(store)
    yield served
    served.stop(grace_s=0)
    store.close()


def _write_layers(client: StateStoreClient, key: str, layers: list[np.ndarray], **kwargs: object) -> None:
    write_layers(client.open_put(key, owner="prefill", **kwargs), layers)  # type: ignore[arg-type]


def write_piece(put: PutStream, layer: int, rows: np.ndarray) -> None:
    """Writes `rows` as layer `layer`'s fp32 KDA piece through `put` (not finished)."""
    put.write_state(
        layer,
        StateKind.KDA_RECURRENT,
        rows.data,
        dtype="float32",
        shape=rows.shape,
        token_start=0,
        token_end=9,
    )


def write_layers(put: PutStream, layers: list[np.ndarray]) -> None:
    """Writes `layers` as one fp32 KDA piece each through `put`, then finishes it."""
    for layer, rows in enumerate(layers):
        write_piece(put, layer, rows)
    put.finish(timeout_s=WAIT_S)


def _read_layers(client: StateStoreClient, key: str, **kwargs: object) -> tuple[list[np.ndarray], list[type]]:
    parts: dict[int, list[np.ndarray]] = {}
    kinds = []
    for chunk in client.get(key, timeout_s=WAIT_S, **kwargs):  # type: ignore[arg-type]
        kinds.append(type(chunk.data))
        parts.setdefault(chunk.meta.layer, []).append(np.frombuffer(chunk.data, np.float32))
    return [np.concatenate(parts[i]) for i in sorted(parts)], kinds


def test_a_reader_on_the_node_gets_views_of_the_arena(shm_server: StateStoreServer) -> None:
    layers = [np.random.default_rng(i).standard_normal(600_000).astype(np.float32) for i in range(3)]
    with StateStoreClient(shm_server.address, timeout_s=WAIT_S) as client:
        assert client.local_arena() is not None
        _write_layers(client, "req", layers)
        got, kinds = _read_layers(client, "req")
        assert all(np.array_equal(a, b) for a, b in zip(got, layers, strict=True))
        assert set(kinds) == {memoryview}  # zero-copy: views of the region, not bytes
        assert len(kinds) == 3  # a piece is one chunk: one commit, one view
        # The gRPC-bytes path (a reader on another node) serves the same regions as bytes.
        got, kinds = _read_layers(client, "req", shared_memory=False)
        assert all(np.array_equal(a, b) for a, b in zip(got, layers, strict=True)) and set(kinds) == {bytes}
        assert len(kinds) == 3  # each piece fits one message (over 3 MiB the store cuts it)
        region_files = list(shm_server.store.arena.directory.glob("*.region"))  # type: ignore[union-attr]
        assert len(region_files) == 1  # the writer's first region (8 MiB) holds all three pieces
        assert client.release("req").num_keys == 1
        assert not list(shm_server.store.arena.directory.glob("*.region"))  # type: ignore[union-attr]


def test_without_an_arena_write_state_sends_bytes(shm_server: StateStoreServer) -> None:
    layers = [np.arange(1000, dtype=np.float32)]
    with StateStoreClient(shm_server.address, timeout_s=WAIT_S) as client:
        _write_layers(client, "req", layers, shared_memory=False)
        assert not list(shm_server.store.arena.directory.glob("*.region"))  # type: ignore[union-attr]
        got, kinds = _read_layers(client, "req")
        assert np.array_equal(got[0], layers[0]) and set(kinds) == {bytes}


def test_a_damaged_region_fails_the_read_closed(shm_server: StateStoreServer) -> None:
    with StateStoreClient(shm_server.address, timeout_s=WAIT_S) as client:
        _write_layers(client, "req", [np.ones(1000, dtype=np.float32)])
        (region,) = shm_server.store.arena.directory.glob("*.region")  # type: ignore[union-attr]
        with open(region, "r+b") as f:
            f.write(b"\xff")
        with pytest.raises(CorruptStateError, match="checksum mismatch"):
            _read_layers(client, "req")
        with pytest.raises(CorruptStateError, match="checksum mismatch"):  # DATA_LOSS over gRPC too
            _read_layers(client, "req", shared_memory=False)


LEASE_S = 1.0  # the killed writer's: long enough to see its piece land, short for the test


def _write_one_piece_then_hang(address: str) -> None:
    """A writer process: opens a put of two layers through the arena, writes the first, hangs."""
    client = StateStoreClient(address, timeout_s=WAIT_S)
    put = client.open_put("req", owner="prefill", lease_s=LEASE_S, shared_memory=True)
    write_piece(put, 0, np.ones(1000, dtype=np.float32))
    signal.pause()  # layer 1 and the seal never come: the parent kills it here


def test_a_writer_killed_mid_put_has_its_regions_freed_by_its_lease(shm_server: StateStoreServer) -> None:
    """A writer process SIGKILLed between two pieces of a put leaves an unsealed key and an
    arena region nobody will finish; its lease runs out and both are gone, region file included."""
    store = shm_server.store
    assert store.arena is not None
    context = multiprocessing.get_context("spawn")
    writer = context.Process(target=_write_one_piece_then_hang, args=(shm_server.address,))
    writer.start()
    try:
        deadline_s = time.monotonic() + WAIT_S
        while (info := store.lookup("req")) is None or not info.chunks:  # its first piece landed
            assert writer.is_alive(), f"the writer exited ({writer.exitcode}) before its piece landed"
            assert time.monotonic() < deadline_s, "the writer's piece never reached the store"
            time.sleep(0.01)
        assert not info.sealed and len(list(store.arena.directory.glob("*.region"))) == 1
        os.kill(writer.pid, signal.SIGKILL)  # type: ignore[arg-type]
        writer.join(WAIT_S)
        assert writer.exitcode == -signal.SIGKILL
        deadline_s = time.monotonic() + WAIT_S
        while store.lookup("req") is not None:  # lookup expires leases on the real monotonic clock
            assert time.monotonic() < deadline_s, "the killed writer's lease never ran out"
            time.sleep(0.01)
        assert not list(store.arena.directory.glob("*.region"))
    finally:
        if writer.is_alive():
            writer.kill()
            writer.join(WAIT_S)


def test_freed_regions_are_reused_within_the_pool(arena_root: Path) -> None:
    store = StateStore(MemoryTier(64 << 20), arena=Arena(arena_root, pool_bytes=1 << 20))
    arena = store.arena
    assert arena is not None
    try:
        first = store.allocate("a", owner="w", num_bytes=4096)
        store.release("a")
        assert arena.pooled_bytes == 4096 and (arena.directory / first).exists()
        assert store.allocate("b", owner="w", num_bytes=3000) == first  # within 2x: reused, no new file
        assert arena.pooled_bytes == 0 and store.stats().tiers[0].num_bytes == 4096
        assert store.allocate("c", owner="w", num_bytes=1000) != first  # 4x too big for it: a new one
        store.allocate("d", owner="w", num_bytes=2 << 20)
        store.release("d")
        assert arena.pooled_bytes == 0  # over the pool: unlinked
    finally:
        store.close()
    assert not arena.directory.exists()


def _hold_an_arena(root: str, ready: multiprocessing.synchronize.Event) -> None:
    store = StateStore(MemoryTier(1 << 20), arena=Arena(root))
    store.allocate("req", owner="prefill", num_bytes=8192)
    ready.set()
    signal.pause()


def test_the_next_store_reclaims_a_killed_stores_arena(arena_root: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=_hold_an_arena, args=(str(arena_root), ready))
    child.start()
    try:
        assert ready.wait(WAIT_S), "the child store did not start"
        (held,) = arena_root.glob("splitserve-tier-*")
        assert len(list(held.glob("*.region"))) == 1
        survivor = Arena(arena_root)  # a live store's arena is never touched
        assert held.exists() and survivor.reclaimed_bytes == 0
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(WAIT_S)
        successor = Arena(arena_root)
        assert not held.exists() and successor.reclaimed_bytes >= 8192
        assert survivor.directory.exists()
        survivor.close()
        successor.close()
    finally:
        if child.is_alive():
            child.kill()
            child.join(WAIT_S)


def test_pieces_over_a_message_are_cut_for_readers_of_bytes(shm_server: StateStoreServer) -> None:
    """MLA pieces numbered by token (two prefill chunks of one layer) and a KDA state, each over
    3 MiB: one view each over shared memory; cut to 1 MiB messages, numbering kept, as bytes."""
    rows = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB
    kda = np.random.default_rng(1).standard_normal((32, 32768)).astype(np.float32)  # 4 MiB
    with StateStoreClient(shm_server.address, timeout_s=WAIT_S) as client:
        put = client.open_put("req", owner="prefill")
        for start, end in ((0, 1024), (1024, 2048)):
            piece = rows[start:end]
            put.write_state(
                0,
                StateKind.MLA_KV,
                piece.data,
                dtype="float32",
                shape=piece.shape,
                token_start=start,
                token_end=end,
                num_tokens=2048,
            )
        put.write_state(
            1,
            StateKind.KDA_RECURRENT,
            kda.data,
            dtype="float32",
            shape=kda.shape,
            token_start=0,
            token_end=2048,
        )
        put.finish(timeout_s=WAIT_S)
        views = list(client.get("req", timeout_s=WAIT_S))
        assert [(c.meta.chunk_index, c.meta.num_chunks) for c in views] == [(0, 2048), (1024, 2048), (0, 1)]
        assert all(isinstance(c.data, memoryview) for c in views)
        cut = list(client.get("req", timeout_s=WAIT_S, shared_memory=False))
        mla = [c for c in cut if c.meta.kind is StateKind.MLA_KV]
        assert [c.meta.chunk_index for c in mla] == list(range(0, 2048, 256))  # by token, 1 MiB each
        assert {c.meta.num_chunks for c in mla} == {2048}
        assert np.array_equal(np.concatenate([np.frombuffer(c.data, np.float32) for c in mla]), rows.ravel())
        recurrent = [c for c in cut if c.meta.kind is StateKind.KDA_RECURRENT]
        assert [(c.meta.chunk_index, c.meta.num_chunks) for c in recurrent] == [(i, 4) for i in range(4)]
        assert b"".join(bytes(c.data) for c in recurrent) == kda.tobytes()


def test_expected_bytes_allocates_one_region_when_the_put_opens(shm_server: StateStoreServer) -> None:
    arena = shm_server.store.arena
    assert arena is not None
    layers = [np.full(300_000, i, dtype=np.float32) for i in range(4)]  # 4.8 MB in all
    with StateStoreClient(shm_server.address, timeout_s=WAIT_S) as client:
        _write_layers(client, "req", layers, expected_bytes=sum(a.nbytes for a in layers))
        (region,) = arena.directory.glob("*.region")  # asked for at open_put, holding all four
        assert region.stat().st_size >= sum(a.nbytes for a in layers)
        got, _ = _read_layers(client, "req")
        assert all(np.array_equal(a, b) for a, b in zip(got, layers, strict=True))
