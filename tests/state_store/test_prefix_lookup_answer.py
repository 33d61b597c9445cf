"""A prefix `Lookup`'s answer: the hit's key and extent without its chunks' metadata (which only
key queries carry, store.proto), and the rest of its key info as before."""

from __future__ import annotations

import asyncio

from splitserve.v1 import store_pb2
from state_store.memory_tier import MemoryTier
from state_store.servicer import StateStoreServicer
from state_store.store import StateStore
from tests.state_store.conftest import make_chunk


def test_a_prefix_hit_answers_key_units_tokens_and_key_info_without_chunk_metadata() -> None:
    store = StateStore(MemoryTier(1 << 20), default_lease_s=5.0)
    try:
        for layer in range(3):
            store.put(make_chunk("p", layer=layer, size=100), owner="w", final=layer == 2)
        store.register([b"u0", b"u1"], "p", tail_token_ids=[7], num_tokens=9)
        servicer = StateStoreServicer(store, executor=None)  # type: ignore[arg-type]  # Lookup runs inline
        prefix = store_pb2.PrefixHashes(hashes=[b"u0", b"u1", b"u2"])
        hit = asyncio.run(
            servicer.Lookup(store_pb2.LookupRequest(prefix=prefix, token_ids=[0] * 8 + [7, 1]), None)
        )
        assert (hit.found, hit.key, hit.num_units, hit.num_tokens) == (True, "p", 2, 9)
        assert (hit.owner, hit.sealed, hit.num_bytes, hit.num_layers) == ("w", True, 300, 3)
        assert len(hit.chunks) == 0
        by_key = asyncio.run(servicer.Lookup(store_pb2.LookupRequest(key="p"), None))
        assert len(by_key.chunks) == 3 and by_key.num_layers == 3  # a key query still lists them
        miss = asyncio.run(
            servicer.Lookup(store_pb2.LookupRequest(prefix=store_pb2.PrefixHashes(hashes=[b"x"])), None)
        )
        assert not miss.found
    finally:
        store.close()
