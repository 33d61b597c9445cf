"""The store's service parks no thread per waiting read: 1,000 reservations wait, then all land."""

from __future__ import annotations

import asyncio

import grpc

from splitserve import rpc
from splitserve.state.client import StateStoreClient
from splitserve.state.wire import chunk_from_proto
from splitserve.v1 import store_pb2, store_pb2_grpc
from state_store.memory_tier import MemoryTier
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.state_store.conftest import make_chunk

NUM_READERS = 1000
WAIT_S = 120.0


async def _read_all(address: str, store: StateStore) -> list[bytes]:
    async with grpc.aio.insecure_channel(address, options=rpc.channel_options()) as channel:
        stub = store_pb2_grpc.StateStoreStub(channel)

        async def read(i: int) -> bytes:
            request = store_pb2.GetRequest(key=f"req-{i}", wait_for_key=True, timeout_s=WAIT_S)
            return b"".join([chunk_from_proto(msg).data async for msg in stub.Get(request)])

        readers = [asyncio.create_task(read(i)) for i in range(NUM_READERS)]
        while store.num_watched_keys < NUM_READERS:  # every read is parked in the store
            await asyncio.sleep(0.05)
            assert not any(task.done() for task in readers), "a read ended before its put"

        def put_all() -> None:  # the puts need the service while all 1,000 reads wait
            with StateStoreClient(address, timeout_s=WAIT_S) as client:
                for i in reversed(range(NUM_READERS)):
                    client.put([make_chunk(f"req-{i}", size=4)], owner="w", seal=True)

        await asyncio.to_thread(put_all)
        return await asyncio.wait_for(asyncio.gather(*readers), WAIT_S)


def test_a_thousand_waiting_reads_do_not_starve_the_puts() -> None:
    store = StateStore(MemoryTier(64 << 20))
    server = StateStoreServer(store, max_workers=4)  # far fewer threads than waiting reads
    try:
        got = asyncio.run(_read_all(server.address, store))
        assert got == [make_chunk(f"req-{i}", size=4).data for i in range(NUM_READERS)]
        assert store.num_watched_keys == 0
    finally:
        server.stop(grace_s=0)
        store.close()
