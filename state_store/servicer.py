"""The gRPC `StateStore` service (proto/store.proto) over one core `StateStore`, on grpc.aio.

A waiting `Get` (a decode reservation waits from Reserve on) is a coroutine parked on an
asyncio event that the store's `watch` callback sets, so it holds no thread: a node can have
thousands outstanding. Store calls that touch bytes (checksums, disk, region files) run on a
small thread pool, so they never stall the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import grpc

from splitserve.state.chunk import MAX_CHUNK_BYTES, Chunk, ChunkMeta, cut
from splitserve.state.errors import StateStoreError, StateTimeoutError
from splitserve.state.status import abort_with_error_async
from splitserve.state.wire import (
    chunk_from_proto,
    chunk_to_proto,
    is_seal,
    key_info_to_proto,
    meta_from_proto,
    stats_to_proto,
)
from splitserve.v1 import common_pb2, store_pb2, store_pb2_grpc
from state_store.arena import PROBE_NAME
from state_store.faults import StoreFaults
from state_store.store import StateStore

SERVICE_NAME = store_pb2.DESCRIPTOR.services_by_name["StateStore"].full_name
T = TypeVar("T")
_ERRORS = (StateStoreError, ValueError)
MAX_BATCH_CHUNKS = 1024  # region references per GetBatch message (~100 bytes each)


class StateStoreServicer(store_pb2_grpc.StateStoreServicer):
    """Serves one core store: owns no state of its own; every chunk travels as one message, as
    bytes or, to a reader on the node that asked for it, as a reference to its arena region.

    Chunks are stored and served at the size written (the core refuses chunks over its
    `max_chunk_bytes`, under 4 MiB), so no message nears gRPC's default limit. Store errors end
    the RPC with their status code and their class name in trailing metadata.
    """

    def __init__(self, store: StateStore, executor: Executor) -> None:
        self.store = store
        self._executor = executor
        self._faults = StoreFaults.from_env()  # None unless a fault test asks (state_store/faults.py)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def Put(
        self, request_iterator: AsyncIterator[common_pb2.StateChunk], context: grpc.aio.ServicerContext
    ) -> store_pb2.PutResponse:
        num_chunks = num_bytes = 0
        try:
            async for msg in request_iterator:
                counted = await self._put_one(msg, context)
                if counted is not None:
                    num_chunks, num_bytes = num_chunks + 1, num_bytes + counted
        except _ERRORS as e:
            await abort_with_error_async(context, e)
        return store_pb2.PutResponse(num_chunks=num_chunks, num_bytes=num_bytes)

    async def PutBatch(
        self, request_iterator: AsyncIterator[store_pb2.StateChunks], context: grpc.aio.ServicerContext
    ) -> store_pb2.PutResponse:
        num_chunks = num_bytes = 0
        try:
            async for batch in request_iterator:
                for msg in batch.chunks:
                    counted = await self._put_one(msg, context)
                    if counted is not None:
                        num_chunks, num_bytes = num_chunks + 1, num_bytes + counted
        except _ERRORS as e:
            await abort_with_error_async(context, e)
        return store_pb2.PutResponse(num_chunks=num_chunks, num_bytes=num_bytes)

    async def _put_one(self, msg: common_pb2.StateChunk, context: grpc.aio.ServicerContext) -> int | None:
        """Stores one Put message: its chunk's bytes, or None for a seal."""
        if self._faults is not None:
            arena = self.store.arena.directory if self.store.arena is not None else None
            if (fault := await self._faults.before_chunk(msg, arena)) is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, fault)
        lease_s = msg.lease_s or None
        if is_seal(msg):
            await self._run(self.store.seal, msg.key, owner=msg.owner)
            return None
        if msg.region:
            meta = meta_from_proto(msg)
            # metadata only, under the store's lock for microseconds: no thread hop
            self.store.put_region(
                meta, msg.region, msg.region_offset, owner=msg.owner, lease_s=lease_s, final=msg.final
            )
            return meta.num_bytes
        chunk = chunk_from_proto(msg)
        await self._run(self.store.put, chunk, owner=msg.owner, lease_s=lease_s, final=msg.final)
        return len(chunk.data)

    async def Get(
        self, request: store_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.StateChunk]:
        try:
            async with contextlib.aclosing(self._chunks(request, context)) as chunks:
                async for msg in chunks:
                    if msg is not None:
                        yield msg
        except _ERRORS as e:
            await abort_with_error_async(context, e)

    async def GetBatch(
        self, request: store_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[store_pb2.StateChunks]:
        batch: list[common_pb2.StateChunk] = []
        try:
            async with contextlib.aclosing(self._chunks(request, context)) as chunks:
                async for msg in chunks:
                    if msg is not None and not msg.data and len(batch) < MAX_BATCH_CHUNKS:
                        batch.append(msg)  # a region reference: goes with the others ready now
                        continue
                    if batch:
                        yield store_pb2.StateChunks(chunks=batch)
                        batch = []
                    if msg is not None:
                        yield store_pb2.StateChunks(chunks=[msg])  # bytes: alone, under the message limit
            if batch:
                yield store_pb2.StateChunks(chunks=batch)
        except _ERRORS as e:
            await abort_with_error_async(context, e)

    async def _chunks(
        self, request: store_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[common_pb2.StateChunk | None, None]:
        """The key's chunks as Get sends them, and None each time it is about to wait (what was
        made so far should go out); raises the store's errors."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        unwatch = self.store.watch(request.key, lambda: loop.call_soon_threadsafe(changed.set))
        limits = [t for t in (request.timeout_s or None, context.time_remaining()) if t is not None]
        deadline = None if not limits else time.monotonic() + min(limits)
        wanted = set(request.layers)
        position = 0
        try:
            while True:
                changed.clear()  # before polling: a change after the poll sets it again
                step = self.store.poll(request.key, position, wait_for_key=request.wait_for_key)
                if step is True:
                    return
                if step is None or step is False:
                    yield None
                    await self._wait(changed, deadline, request.key, position)
                    continue
                position += 1
                if wanted and step.layer not in wanted:
                    continue
                place = self.store.location(step) if request.regions else None
                if place is not None:
                    yield chunk_to_proto(step, region=place[0], region_offset=place[1])
                elif step.num_bytes <= MAX_CHUNK_BYTES:
                    yield chunk_to_proto(Chunk(step, await self._run(self.store.read, step)))
                else:  # a whole region piece, to a reader off the node: cut to fit gRPC messages
                    for chunk in await self._run(self._cut, step):
                        yield chunk_to_proto(chunk)
        finally:
            unwatch()

    def _cut(self, meta: ChunkMeta) -> list[Chunk]:
        """A region piece's verified bytes as chunks of one message each (checksummed anew)."""
        return cut(meta, self.store.read(meta))

    @staticmethod
    async def _wait(changed: asyncio.Event, deadline: float | None, key: str, position: int) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise StateTimeoutError(
                f"key {key!r} was not sealed in time ({position} chunks arrived); is its writer still running?"
            )
        with contextlib.suppress(TimeoutError):  # the next round raises the timeout
            await asyncio.wait_for(changed.wait(), remaining)

    async def Lookup(
        self, request: store_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.LookupResponse:
        if request.WhichOneof("query") == "prefix":
            token_ids = list(request.token_ids) or None
            found = self.store.match_prefix(list(request.prefix.hashes), token_ids)
            info = self.store.lookup(found.key) if found.key is not None else None
            if info is None:
                return store_pb2.LookupResponse(found=False)
            # Without its chunks' metadata (store.proto: for key queries): a prefix hit's readers
            # want its key and extent, and encoding a long history's hundreds of chunk metas cost
            # more than the rest of the call.
            reply = key_info_to_proto(dataclasses.replace(info, chunks=()), found.num_units, found.num_tokens)
            reply.num_layers = info.num_layers
            return reply
        return key_info_to_proto(self.store.lookup(request.key))

    async def Register(
        self, request: store_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.RegisterResponse:
        try:
            self.store.register(
                list(request.prefix.hashes),
                request.key,
                tail_token_ids=list(request.tail_token_ids),
                num_tokens=request.num_tokens,
            )
        except _ERRORS as e:
            await abort_with_error_async(context, e)
        return store_pb2.RegisterResponse()

    async def Renew(
        self, request: store_pb2.RenewRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.RenewResponse:
        try:
            remaining_s = self.store.renew(request.key, request.lease_s, request.owner)
        except _ERRORS as e:
            await abort_with_error_async(context, e)
        return store_pb2.RenewResponse(lease_expiry_unix_s=time.time() + remaining_s)

    async def Release(
        self, request: store_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.ReleaseResponse:
        target = request.WhichOneof("target")
        try:
            if target is None:
                raise ValueError("ReleaseRequest names neither a key nor an owner")
            if target == "owner":
                result = await self._run(self.store.release, owner=request.owner)
            else:
                result = await self._run(self.store.release, key=request.key)
        except _ERRORS as e:
            await abort_with_error_async(context, e)
        return store_pb2.ReleaseResponse(num_keys=result.num_keys, num_bytes=result.num_bytes)

    async def Stats(
        self, request: store_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.StoreStats:
        return stats_to_proto(self.store.stats())

    async def Arena(
        self, request: store_pb2.ArenaRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.ArenaInfo:
        arena = self.store.arena
        if arena is None:
            return store_pb2.ArenaInfo()
        info = store_pb2.ArenaInfo(
            directory=str(arena.directory), probe_name=PROBE_NAME, probe_token=arena.probe_token
        )
        endpoint = arena.endpoint
        if endpoint is not None:  # a transfer engine serves the arena to other nodes
            info.transfer_engine, info.transfer_endpoint = endpoint.engine, endpoint.address
            info.region_addresses.update(arena.addresses(list(request.regions)))
        return info

    async def Allocate(
        self, request: store_pb2.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.AllocateResponse:
        try:
            region = await self._run(
                self.store.allocate,
                request.key,
                owner=request.owner,
                num_bytes=request.num_bytes,
                lease_s=request.lease_s or None,
            )
        except _ERRORS as e:
            await abort_with_error_async(context, e)
        return store_pb2.AllocateResponse(region=region)
