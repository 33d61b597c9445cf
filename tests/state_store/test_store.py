"""The core store: ownership, sealing, release by key and by owner, lookup, prefixes, chunking."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitserve.state.chunk import DEFAULT_CHUNK_BYTES, StateKind, make_chunks
from splitserve.state.errors import KeySealedError, OwnershipError, StateReleasedError
from state_store.memory_tier import MemoryTier
from state_store.store import StateStore
from tests.state_store.conftest import FakeClock, make_chunk


@pytest.fixture
def store(clock: FakeClock) -> Iterator[StateStore]:
    made = StateStore(MemoryTier(1 << 24), clock=clock)
    yield made
    made.close()


def test_release_by_owner_frees_every_key_and_byte_it_holds(store: StateStore) -> None:
    for key in ("a", "b", "c"):
        for layer in range(3):
            store.put(make_chunk(key, layer, size=1000), owner="prefill-0")
    store.put(make_chunk("other", size=500), owner="prefill-1")
    assert store.release(owner="prefill-0") == (3, 9000)
    stats = store.stats()
    assert (stats.num_keys, stats.num_bytes, stats.num_objects) == (1, 500, 1)
    assert store.release(key="other") == (1, 500)
    stats = store.stats()
    assert (stats.num_keys, stats.num_bytes, stats.num_objects, stats.num_releases) == (0, 0, 0, 4)
    with pytest.raises(StateReleasedError, match="released by owner 'prefill-0'"):
        list(store.get("a"))


def test_release_is_idempotent_and_takes_one_target(store: StateStore) -> None:
    assert store.release(key="never") == (0, 0)
    with pytest.raises(ValueError, match="exactly one"):
        store.release()


def test_only_the_owner_writes_and_a_sealed_key_takes_no_more(store: StateStore) -> None:
    store.put(make_chunk("req", 0), owner="w")
    with pytest.raises(OwnershipError, match="belongs to 'w'"):
        store.put(make_chunk("req", 1), owner="intruder")
    with pytest.raises(KeySealedError, match="already stored"):
        store.put(make_chunk("req", 0), owner="w")
    store.seal("req", owner="w")
    with pytest.raises(KeySealedError, match="sealed"):
        store.put(make_chunk("req", 2), owner="w")


def test_lookup_describes_a_key_without_its_bytes(store: StateStore) -> None:
    store.put(make_chunk("req", 0, size=10), owner="w")
    store.put(make_chunk("req", 3, size=20, kind=StateKind.KDA_CONV), owner="w", final=True)
    info = store.lookup("req")
    assert info is not None
    assert (info.owner, info.sealed, info.num_bytes, info.num_layers) == ("w", True, 30, 2)
    assert [(c.layer, c.kind) for c in info.chunks] == [(0, StateKind.KDA_RECURRENT), (3, StateKind.KDA_CONV)]
    assert store.lookup("missing") is None


def test_get_can_select_layers(store: StateStore) -> None:
    for layer in range(4):
        store.put(make_chunk("req", layer), owner="w", final=layer == 3)
    assert [c.meta.layer for c in store.get("req", layers=[1, 3])] == [1, 3]


def test_longest_prefix_match_returns_the_longest_sealed_registered_prefix(store: StateStore) -> None:
    chain = [b"h0", b"h1", b"h2", b"h3"]
    for key, units in (("short", 1), ("long", 3)):
        store.put(make_chunk(key), owner="w", final=True)
        store.register(chain[:units], key)
    store.put(make_chunk("unsealed"), owner="w")
    store.register(chain, "unsealed")  # complete prefixes only: not reported until sealed
    assert store.longest_match(chain) == (3, "long")
    assert store.longest_match([b"h0", b"other"]) == (1, "short")
    assert store.longest_match([b"x"]) == (0, None)
    store.seal("unsealed", owner="w")
    assert store.longest_match(chain) == (4, "unsealed")
    store.release(key="unsealed")
    store.release(key="long")
    assert store.longest_match(chain) == (1, "short")
    assert store.stats().num_prefix_hits == 4


def test_make_chunks_splits_rows_under_the_limit_and_reassembles(store: StateStore) -> None:
    rows, width = 1000, 576 * 2  # MLA KV rows of bf16 kv_lora_rank + rope
    data = bytes(range(256)) * (rows * width // 256) + bytes(rows * width % 256)
    chunks = make_chunks(
        "req", 5, "mla_kv", data, dtype="bfloat16", shape=(rows, 576), token_start=0, token_end=rows
    )
    assert len(chunks) == -(-len(data) // DEFAULT_CHUNK_BYTES)
    assert all(len(c.data) <= DEFAULT_CHUNK_BYTES for c in chunks)
    assert [c.meta.chunk_index for c in chunks] == list(range(len(chunks)))
    assert chunks[0].meta.token_start == 0 and chunks[-1].meta.token_end == rows
    assert all(a.meta.token_end == b.meta.token_start for a, b in zip(chunks, chunks[1:]))
    for i, chunk in enumerate(chunks):
        store.put(chunk, owner="w", final=i == len(chunks) - 1)
    assert b"".join(c.data for c in store.get("req")) == data


def test_make_chunks_refuses_a_row_bigger_than_a_chunk() -> None:
    with pytest.raises(ValueError, match="reshape so dim 0 is finer"):
        make_chunks(
            "k",
            0,
            "kda_recurrent",
            bytes(8 * 4096),
            dtype="float32",
            shape=(1, 8 * 1024),
            token_start=0,
            token_end=4,
            max_chunk_bytes=4096,
        )


def test_closing_the_store_frees_everything(store: StateStore) -> None:
    store.put(make_chunk("req"), owner="w")
    store.close()
    assert store.stats().num_bytes == 0
    with pytest.raises(StateReleasedError, match="closed"):
        store.put(make_chunk("new"), owner="w")


def test_a_renewal_with_an_owner_hands_the_key_over(store: StateStore) -> None:
    # a decode worker keeping a prefill's prompt state in place adopts it
    store.put(make_chunk("req", 0), owner="prefill")
    store.seal("req", owner="prefill")
    store.renew("req", 30.0, owner="decode")
    assert store.release(owner="prefill").num_keys == 0  # no longer the writer's
    assert store.release(owner="decode").num_keys == 1
    with pytest.raises(StateReleasedError):
        list(store.get("req"))
