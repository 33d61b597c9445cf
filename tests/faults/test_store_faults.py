"""Store faults over real gRPC: reads after eviction, a SIGKILLed writer's partial object, and the
fault hook itself (every Nth operation failed, a byte flipped on the bytes and the arena path)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from splitserve.state import StateKind
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import (
    CorruptStateError,
    LeaseExpiredError,
    StateEvictedError,
    StateUnavailableError,
)
from state_store.arena import Arena
from state_store.faults import ENV_VAR, StoreFaults
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.faults.conftest import wait_for
from tests.state_store.conftest import make_chunk

WAIT_S = 30.0  # a guard against a hang: every read below must end with an error well before it


@pytest.fixture
def small_server() -> Iterator[StateStoreServer]:
    """A store of 4 KiB of RAM and no disk: a second 3 KiB key evicts the first."""
    store = StateStore(MemoryTier(4096))
    served = StateStoreServer(store)
    yield served
    served.stop(grace_s=0)
    store.close()


def test_a_read_after_eviction_is_a_clear_error_not_a_hang(small_server: StateStoreServer) -> None:
    with StateStoreClient(small_server.address, timeout_s=WAIT_S) as client:
        client.put([make_chunk("old", size=3000)], owner="prefill", seal=True)
        client.put([make_chunk("new", size=3000)], owner="prefill", seal=True)
        with pytest.raises(StateEvictedError, match="'old' was evicted .*memory_bytes"):
            list(client.get("old", timeout_s=WAIT_S))
        assert [c.meta.key for c in client.get("new", timeout_s=WAIT_S)] == ["new"]
        assert client.stats().num_evictions == 1


def test_a_reader_waiting_mid_key_is_told_of_its_eviction(small_server: StateStoreServer) -> None:
    """The reader has the key's first chunk and waits for more when a bigger key pushes it out."""
    outcome: list[BaseException | None] = []
    got_first = threading.Event()
    with StateStoreClient(small_server.address, timeout_s=WAIT_S) as client:
        client.put([make_chunk("partial", index=0, num_chunks=2, size=2000)], owner="prefill")

        def read() -> None:
            try:
                for _ in client.get("partial", timeout_s=WAIT_S):
                    got_first.set()
                outcome.append(None)
            except BaseException as exc:  # handed to the test thread
                outcome.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        assert got_first.wait(WAIT_S)
        client.put([make_chunk("big", size=3000)], owner="prefill", seal=True)
        reader.join(WAIT_S)
    assert not reader.is_alive(), "the reader hung after its key was evicted"
    assert len(outcome) == 1 and isinstance(outcome[0], StateEvictedError), outcome


# A writer that allocates a region, commits one piece of a key in it, says so, and waits to be killed.
_WRITER = """
import sys, numpy as np
from splitserve.state import StateKind
from splitserve.state.client import StateStoreClient
client = StateStoreClient(sys.argv[1])
assert client.local_arena() is not None, "the writer must share the store's arena"
put = client.open_put("crashed", owner="prefill-0", lease_s=2.0, expected_bytes=1 << 20)
rows = np.ones((64, 512), np.float32)
put.write_state(0, StateKind.MLA_KV, rows.data, dtype="float32", shape=rows.shape, token_start=0, token_end=64)
print("written", flush=True)
sys.stdin.read()
"""


def test_a_writer_killed_mid_put_leaves_nothing_behind(tmp_path: Path) -> None:
    store = StateStore(MemoryTier(64 << 20), arena=Arena(tmp_path / "arenas", pool_bytes=0))
    server = StateStoreServer(store, reap_interval_s=0.2)
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, server.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "written", writer.stderr
        # the piece is committed (not just queued) before the kill: a partial, unsealed object
        wait_for(lambda: (info := store.lookup("crashed")) is not None and len(info.chunks) == 1, "the piece")
        assert list((tmp_path / "arenas").glob("*/*.region"))
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(WAIT_S)
        # its lease (2 s) runs out unclaimed and the reaper frees the key, its bytes and its region
        wait_for(lambda: store.stats().num_keys == 0, "the crashed writer's key freed by its lease")
        stats = store.stats()
        assert stats.num_expiries == 1 and stats.num_bytes == 0
        assert not list((tmp_path / "arenas").glob("*/*.region"))
        with StateStoreClient(server.address, timeout_s=WAIT_S) as client:
            with pytest.raises(LeaseExpiredError, match="'crashed' expired"):
                list(client.get("crashed", timeout_s=WAIT_S))
            client.put([make_chunk("after")], owner="prefill-1", seal=True)  # the store still works
            assert client.lookup("after") is not None
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(WAIT_S)
        server.stop(grace_s=0)
        store.close()


def test_the_fault_hook_is_inert_without_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert StoreFaults.from_env() is None


@pytest.fixture
def fault_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "faults.json"
    monkeypatch.setenv(ENV_VAR, str(path))  # read when a server's servicer is made
    return path


def test_every_nth_operation_fails_its_put_and_is_logged(fault_file: Path) -> None:
    fault_file.write_text(json.dumps({"fail_every": 3}))
    store = StateStore(MemoryTier(1 << 20))
    with StateStoreServer(store) as server, StateStoreClient(server.address, timeout_s=WAIT_S) as client:
        outcomes = []
        for i in range(4):
            chunks = [make_chunk(f"req-{i}", layer=layer) for layer in range(2)]
            try:
                client.put(chunks, owner="prefill", seal=True)
                outcomes.append("ok")
            except StateUnavailableError as exc:
                assert "injected fault" in str(exc)
                outcomes.append("failed")
        # chunk 3 (req-1's first) fails and ends its Put; 4, 5 are req-2's; 6 is req-3's first.
        # Seals are not operations.
        assert outcomes == ["ok", "failed", "ok", "failed"]
        assert Path(f"{fault_file}.log").read_text().split("\n") == ["fail req-1", "fail req-3", ""]
        assert client.lookup("req-1") is None  # the failed chunk was never stored
        fault_file.write_text(json.dumps({}))  # a changed file takes effect at once
        client.put([make_chunk("req-9", layer=layer) for layer in range(3)], owner="prefill", seal=True)
    store.close()


def test_a_flipped_byte_is_refused_on_the_bytes_path(fault_file: Path) -> None:
    fault_file.write_text(json.dumps({"flip_every": 1, "flip_kind": "kda_conv"}))
    store = StateStore(MemoryTier(1 << 20))
    with StateStoreServer(store) as server, StateStoreClient(server.address, timeout_s=WAIT_S) as client:
        client.put([make_chunk("fine", kind=StateKind.MLA_KV)], owner="prefill", seal=True)
        with pytest.raises(CorruptStateError, match="as received: checksum mismatch"):
            client.put([make_chunk("hit", kind=StateKind.KDA_CONV)], owner="prefill", seal=True)
        assert client.stats().num_corruptions == 1
    store.close()


def test_a_flipped_byte_in_the_arena_is_refused_by_the_reader(fault_file: Path, tmp_path: Path) -> None:
    fault_file.write_text(json.dumps({"flip_every": 2, "flip_kind": "mla_kv"}))
    store = StateStore(MemoryTier(64 << 20), arena=Arena(tmp_path / "arenas"))
    rows = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    with StateStoreServer(store) as server, StateStoreClient(server.address, timeout_s=WAIT_S) as client:
        for key in ("first", "second"):
            put = client.open_put(key, owner="prefill", shared_memory=True)
            put.write_state(
                0, StateKind.MLA_KV, rows.data, dtype="float32", shape=rows.shape, token_start=0, token_end=64
            )
            put.finish(WAIT_S)
        assert np.array_equal(np.frombuffer(next(iter(client.get("first"))).data, np.float32), rows.ravel())
        with pytest.raises(CorruptStateError, match="as received: checksum mismatch"):
            list(client.get("second", timeout_s=WAIT_S))
    assert Path(f"{fault_file}.log").read_text() == "flip mla_kv second\n"
    store.close()


def test_held_puts_wait_for_the_file_and_other_keys_pass(fault_file: Path) -> None:
    fault_file.write_text(json.dumps({"hold_puts": True, "key_prefix": "decode-0/"}))
    store = StateStore(MemoryTier(1 << 20))
    with StateStoreServer(store) as server, StateStoreClient(server.address, timeout_s=WAIT_S) as client:
        client.put([make_chunk("prefix-a")], owner="prefill", seal=True)  # not a held key: stored at once
        held = threading.Thread(
            target=client.put, args=([make_chunk("decode-0/req")],), kwargs={"owner": "p"}
        )
        held.start()
        wait_for(lambda: Path(f"{fault_file}.log").exists(), "the put held")
        assert Path(f"{fault_file}.log").read_text() == "hold decode-0/req\n"
        assert client.lookup("decode-0/req") is None  # its chunk waits outside the store
        fault_file.write_text(json.dumps({}))
        held.join(WAIT_S)
        assert not held.is_alive() and client.lookup("decode-0/req") is not None
    store.close()
