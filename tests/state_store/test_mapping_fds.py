"""Mapped arena regions hold no open file: the fd count does not grow with the number of regions."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

from splitserve.state.mapping import map_file
from splitserve.state.shm import LocalArena
from state_store.arena import Arena

NUM_REGIONS = 200
REGION_BYTES = 4096


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mapped_ranges(path_part: str) -> int:
    """Lines of /proc/self/maps naming a file under `path_part` (mappings alive now)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if path_part in line)


pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")


def test_store_and_clients_map_many_regions_without_an_fd_each(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arenas", pool_bytes=0)
    try:
        before = open_fds()
        regions = [arena.allocate(REGION_BYTES) for _ in range(NUM_REGIONS)]
        writer = LocalArena(str(arena.directory))
        reader = LocalArena(str(arena.directory))
        for i, region in enumerate(regions):
            writer.map(region.name, writable=True)[:8] = i.to_bytes(8, "little")
        views = [reader.read(region.name, 0, 8) for region in regions]
        # 3 mappings of each of 200 regions (store, writer, reader): a few fds at most, not 600
        assert open_fds() - before < 10
        assert [int.from_bytes(view, "little") for view in views] == list(range(NUM_REGIONS))
        assert all(view.readonly for view in views)
        assert bytes(regions[7].view[:8]) == (7).to_bytes(8, "little")  # the store sees the writes too
    finally:
        arena.close()


def test_a_mapping_outlives_its_file_and_is_unmapped_once_its_last_view_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "region"
    path.write_bytes(bytes(range(256)) * 16)
    fd = os.open(path, os.O_RDONLY)
    try:
        whole = map_file(fd, 4096, writable=False, populate=True)
    finally:
        os.close(fd)
    part = np.frombuffer(whole[256:512], np.uint8)  # a numpy array over a slice keeps it mapped
    path.unlink()
    del whole
    gc.collect()
    assert mapped_ranges(str(tmp_path)) == 1
    assert part.tolist() == list(range(256))
    with pytest.raises(ValueError):
        part[0] = 1  # read-only: writing would fault, numpy refuses instead
    del part
    gc.collect()
    assert mapped_ranges(str(tmp_path)) == 0


def test_an_empty_file_maps_to_an_empty_view(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.touch()
    fd = os.open(path, os.O_RDWR)
    try:
        assert map_file(fd, 0, writable=True).nbytes == 0
    finally:
        os.close(fd)


def test_a_refused_mapping_raises_oserror(tmp_path: Path) -> None:
    path = tmp_path / "region"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            map_file(fd, 4096, writable=True)  # a shared writable mapping of a read-only fd
    finally:
        os.close(fd)
