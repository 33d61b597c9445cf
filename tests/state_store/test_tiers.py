"""Both tiers keep the `Tier` contract: byte capacity, LRU eviction, pins, removal, close."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.state.errors import TierFullError
from state_store.disk_tier import DiskTier
from state_store.memory_tier import MemoryTier
from state_store.tier import Tier


@pytest.fixture(params=["memory", "disk"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    made: Tier = MemoryTier(300) if request.param == "memory" else DiskTier(tmp_path, 300)
    yield made
    made.close()


def blob(tag: int, size: int = 100) -> bytes:
    return bytes([tag]) * size


def test_put_get_round_trip_and_contains(tier: Tier) -> None:
    assert tier.put("a", blob(1)) == []
    assert tier.contains("a") and not tier.contains("b")
    assert tier.get("a") == blob(1)
    assert tier.get("b") is None
    assert tier.stats().num_bytes == 100 and tier.stats().num_objects == 1


def test_least_recently_used_is_evicted_first_and_get_refreshes(tier: Tier) -> None:
    for name in "abc":
        tier.put(name, blob(ord(name)))
    tier.get("a")  # now b is the least recently used
    evicted = tier.put("d", blob(4))
    assert [e.oid for e in evicted] == ["b"]
    assert not tier.contains("b") and all(tier.contains(n) for n in "acd")
    assert tier.stats().num_bytes <= tier.capacity_bytes


def test_memory_hands_evicted_bytes_back_and_disk_does_not(tier: Tier) -> None:
    for name in "abc":
        tier.put(name, blob(ord(name)))
    (evicted,) = tier.put("d", blob(4))
    assert evicted.data == (blob(ord("a")) if isinstance(tier, MemoryTier) else None)


def test_pinned_objects_are_never_evicted(tier: Tier) -> None:
    for name in "abc":
        tier.put(name, blob(ord(name)))
    assert tier.pin("a") and tier.pin("b")
    assert [e.oid for e in tier.put("d", blob(4))] == ["c"]
    with pytest.raises(TierFullError, match="pinned"):
        tier.put("e", blob(5, 200))
    assert all(tier.contains(n) for n in "abd") and not tier.contains("e")
    assert tier.stats().num_pinned == 2


def test_pins_count_and_unpin_makes_evictable_again(tier: Tier) -> None:
    for name in "abc":
        tier.put(name, blob(ord(name)))
    tier.pin("a")
    tier.pin("a")
    tier.unpin("a")
    assert [e.oid for e in tier.put("d", blob(4))] == ["b"]  # a still pinned once
    tier.unpin("a")
    assert not tier.unpin("a")
    assert [e.oid for e in tier.put("e", blob(5))] == ["a"]


def test_object_larger_than_capacity_is_refused_without_evicting(tier: Tier) -> None:
    tier.put("a", blob(1))
    with pytest.raises(TierFullError, match="capacity"):
        tier.put("big", blob(2, 301))
    assert tier.contains("a") and tier.stats().num_bytes == 100


def test_remove_frees_bytes_even_when_pinned(tier: Tier) -> None:
    tier.put("a", blob(1))
    tier.pin("a")
    assert tier.remove("a") == 100
    assert tier.remove("a") == 0
    assert tier.stats().num_bytes == 0 and tier.stats().num_pinned == 0
    assert not tier.pin("a")


def test_put_of_an_existing_id_replaces_it(tier: Tier) -> None:
    tier.put("a", blob(1))
    tier.put("a", blob(2, 50))
    assert tier.get("a") == blob(2, 50)
    assert tier.stats().num_bytes == 50 and tier.stats().num_objects == 1


def test_disk_tier_owns_a_private_directory_and_close_deletes_it(tmp_path: Path) -> None:
    first, second = DiskTier(tmp_path, 1000), DiskTier(tmp_path, 1000)
    first.put("a", blob(1))
    second.put("a", blob(2))
    assert first.directory != second.directory
    path = first.path_of("a")
    assert path is not None and path.read_bytes() == blob(1)
    first.close()
    assert not first.directory.exists() and second.get("a") == blob(2)
    second.close()
    assert list(tmp_path.iterdir()) == []


_DIES_HOLDING_A_TIER = """
import os, signal, sys
from state_store.disk_tier import DiskTier
tier = DiskTier(sys.argv[1], 10_000)
tier.put("a", b"x" * 4000)
print(tier.directory, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_new_disk_tier_reclaims_what_a_killed_store_left_and_spares_live_ones(tmp_path: Path) -> None:
    live = DiskTier(tmp_path, 1000)
    live.put("kept", blob(3))
    killed = subprocess.run(
        [sys.executable, "-c", _DIES_HOLDING_A_TIER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    abandoned = Path(killed.stdout.strip())
    assert abandoned.is_dir() and any(f.suffix == ".bin" for f in abandoned.iterdir())

    fresh = DiskTier(tmp_path, 1000)
    assert fresh.reclaimed_bytes >= 4000
    assert not abandoned.exists()
    assert live.get("kept") == blob(3)  # held by this process: its lock kept it
    assert sorted(tmp_path.iterdir()) == sorted([live.directory, fresh.directory])
    live.close()
    fresh.close()
