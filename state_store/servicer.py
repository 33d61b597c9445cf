"""The gRPC `StateStore` service (proto/store.proto) over one core `StateStore`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc

from splitserve.state.errors import StateStoreError
from splitserve.state.status import abort_with_error
from splitserve.state.wire import chunk_from_proto, chunk_to_proto, is_seal, key_info_to_proto, stats_to_proto
from splitserve.v1 import common_pb2, store_pb2, store_pb2_grpc
from state_store.store import StateStore

SERVICE_NAME = store_pb2.DESCRIPTOR.services_by_name["StateStore"].full_name


class StateStoreServicer(store_pb2_grpc.StateStoreServicer):
    """Serves one core store: owns no state of its own; every chunk travels as one message.

    Chunks are stored and served at the size written (the core refuses chunks over its
    `max_chunk_bytes`, under 4 MiB), so no message nears gRPC's default limit. Store errors end
    the RPC with their status code and their class name in trailing metadata.
    """

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def Put(
        self, request_iterator: Iterator[common_pb2.StateChunk], context: grpc.ServicerContext
    ) -> store_pb2.PutResponse:
        num_chunks = num_bytes = 0
        try:
            for msg in request_iterator:
                if is_seal(msg):
                    self.store.seal(msg.key, owner=msg.owner)
                    continue
                chunk = chunk_from_proto(msg)
                self.store.put(chunk, owner=msg.owner, lease_s=msg.lease_s or None, final=msg.final)
                num_chunks += 1
                num_bytes += len(chunk.data)
        except (StateStoreError, ValueError) as e:
            abort_with_error(context, e)
        return store_pb2.PutResponse(num_chunks=num_chunks, num_bytes=num_bytes)

    def Get(
        self, request: store_pb2.GetRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.StateChunk]:
        cancel = threading.Event()

        def stop_waiting() -> None:  # runs when the RPC ends for any reason, cancellation included
            cancel.set()
            self.store.wake(request.key)

        context.add_callback(stop_waiting)
        limits = [t for t in (request.timeout_s or None, context.time_remaining()) if t is not None]
        try:
            chunks = self.store.get(
                request.key,
                layers=list(request.layers) or None,
                timeout_s=min(limits, default=None),
                cancel=cancel,
                wait_for_key=request.wait_for_key,
            )
            for chunk in chunks:
                yield chunk_to_proto(chunk)
        except (StateStoreError, ValueError) as e:
            abort_with_error(context, e)

    def Lookup(
        self, request: store_pb2.LookupRequest, context: grpc.ServicerContext
    ) -> store_pb2.LookupResponse:
        if request.WhichOneof("query") == "prefix":
            num_units, key = self.store.longest_match(list(request.prefix.hashes))
            info = self.store.lookup(key) if key is not None else None
            return key_info_to_proto(info, num_units) if info else store_pb2.LookupResponse(found=False)
        return key_info_to_proto(self.store.lookup(request.key))

    def Register(
        self, request: store_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> store_pb2.RegisterResponse:
        try:
            self.store.register(list(request.prefix.hashes), request.key)
        except (StateStoreError, ValueError) as e:
            abort_with_error(context, e)
        return store_pb2.RegisterResponse()

    def Renew(
        self, request: store_pb2.RenewRequest, context: grpc.ServicerContext
    ) -> store_pb2.RenewResponse:
        try:
            remaining_s = self.store.renew(request.key, request.lease_s)
        except (StateStoreError, ValueError) as e:
            abort_with_error(context, e)
        return store_pb2.RenewResponse(lease_expiry_unix_s=time.time() + remaining_s)

    def Release(
        self, request: store_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> store_pb2.ReleaseResponse:
        target = request.WhichOneof("target")
        try:
            if target is None:
                raise ValueError("ReleaseRequest names neither a key nor an owner")
            if target == "owner":
                result = self.store.release(owner=request.owner)
            else:
                result = self.store.release(key=request.key)
        except (StateStoreError, ValueError) as e:
            abort_with_error(context, e)
        return store_pb2.ReleaseResponse(num_keys=result.num_keys, num_bytes=result.num_bytes)

    def Stats(self, request: store_pb2.StatsRequest, context: grpc.ServicerContext) -> store_pb2.StoreStats:
        return stats_to_proto(self.store.stats())
