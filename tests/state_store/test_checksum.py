"""A flipped byte anywhere (wire, RAM, disk) raises CorruptStateError; bad bytes never come out."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.state.chunk import Chunk
from splitserve.state.errors import CorruptStateError
from state_store.disk_tier import DiskTier
from state_store.memory_tier import MemoryTier
from state_store.store import StateStore
from tests.state_store.conftest import make_chunk


def flipped(data: bytes | memoryview, at: int = 17) -> bytes:
    data = bytes(data)
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def test_a_chunk_whose_bytes_do_not_match_its_checksum_is_refused_on_put() -> None:
    store = StateStore(MemoryTier(1 << 20))
    good = make_chunk("req")
    with pytest.raises(CorruptStateError, match="as received: checksum mismatch"):
        store.put(Chunk(good.meta, flipped(good.data)), owner="w")
    assert store.stats().num_corruptions == 1 and store.stats().num_bytes == 0
    store.close()


def test_a_byte_flipped_in_memory_raises_on_read_and_the_key_is_dropped() -> None:
    memory = MemoryTier(1 << 20)
    store = StateStore(memory)
    chunk = make_chunk("req")
    store.put(chunk, owner="w", final=True)
    memory._objects[chunk.meta.id] = flipped(chunk.data)  # simulate a bit flip in RAM
    with pytest.raises(CorruptStateError, match="layer 0 kda_recurrent chunk 0/1 as stored"):
        list(store.get("req"))
    with pytest.raises(CorruptStateError):  # later readers are told too, never served
        list(store.get("req"))
    stats = store.stats()
    assert stats.num_corruptions == 1 and stats.num_bytes == 0 and store.lookup("req") is None
    store.close()


def test_a_byte_flipped_on_disk_raises_on_read(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    store = StateStore(MemoryTier(0), disk)  # everything lands on disk
    chunk = make_chunk("req", size=4096)
    store.put(chunk, owner="w", final=True)
    path = disk.path_of(chunk.meta.id)
    assert path is not None
    path.write_bytes(flipped(path.read_bytes(), at=4000))
    with pytest.raises(CorruptStateError, match="checksum mismatch"):
        list(store.get("req"))
    assert store.stats().num_corruptions == 1
    store.close()


def test_a_file_deleted_under_the_disk_tier_is_reported_as_corruption(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    store = StateStore(MemoryTier(0), disk)
    chunk = make_chunk("req")
    store.put(chunk, owner="w", final=True)
    path = disk.path_of(chunk.meta.id)
    assert path is not None
    path.unlink()
    with pytest.raises(CorruptStateError, match="vanished"):
        list(store.get("req"))
    store.close()


def test_metadata_that_disagrees_with_the_bytes_is_refused() -> None:
    chunk = make_chunk("req", size=100)
    with pytest.raises(ValueError, match="100 bytes, but shape"):
        Chunk(replace(chunk.meta, shape=(99,)), chunk.data)
