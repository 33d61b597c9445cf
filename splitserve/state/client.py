"""A Python client of a remote StateStore that speaks the core store's API and raises its errors."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import TypeVar

import grpc

from splitserve import rpc
from splitserve.state.chunk import Chunk
from splitserve.state.errors import StateUnavailableError
from splitserve.state.records import KeyInfo, ReleaseResult, StoreStats
from splitserve.state.status import error_from_rpc
from splitserve.state.streams import ChunkStream, PutStream
from splitserve.state.wire import chunk_to_proto, key_info_from_proto, seal_message, stats_from_proto
from splitserve.v1 import common_pb2, store_pb2, store_pb2_grpc

T = TypeVar("T")
DEADLINE_GRACE_S = 5.0  # a Get's own deadline trails the store's timeout, whose error says more


class StateStoreClient:
    """One channel to one store server. Methods mirror `StateStore`'s and raise its errors.

    Owns the channel (`close`, or use as a context manager). Thread-safe: gRPC channels and stubs
    are. Unary calls take `timeout_s`; `put` has no deadline of its own, `open_put` is bounded by
    its `finish`, `get` by its `timeout_s`.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        max_message_bytes: int = rpc.MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = rpc.make_channel(address, max_message_bytes)
        self._stub = store_pb2_grpc.StateStoreStub(self._channel)

    def put(
        self, chunks: Iterable[Chunk], *, owner: str, lease_s: float | None = None, seal: bool = False
    ) -> tuple[int, int]:
        """Streams `chunks` in one Put (then seals their key if `seal`); returns (chunks, bytes)."""

        def messages() -> Iterator[common_pb2.StateChunk]:
            key = None
            for chunk in chunks:
                key = chunk.meta.key
                yield chunk_to_proto(chunk, owner=owner, lease_s=lease_s or 0.0)
            if seal and key is not None:
                yield seal_message(key, owner)

        reply = self._call(lambda: self._stub.Put(messages()))
        return reply.num_chunks, reply.num_bytes

    def open_put(self, key: str, *, owner: str, lease_s: float | None = None) -> PutStream:
        """A Put of `key` that stays open: `write` chunks as they are made, then `finish` or `cancel`."""
        return PutStream(self._stub, key, owner, lease_s)

    def seal(self, key: str, *, owner: str) -> None:
        self._call(lambda: self._stub.Put(iter([seal_message(key, owner)]), timeout=self.timeout_s))

    def get(
        self,
        key: str,
        *,
        layers: Collection[int] | None = None,
        timeout_s: float | None = None,
        wait_for_key: bool = False,
    ) -> ChunkStream:
        """Streams `key`'s chunks as they land, until it is sealed; checksums are checked here too.

        With `wait_for_key` a key not yet put is waited for rather than NOT_FOUND. The store fails
        the read with `StateTimeoutError` if the key is not sealed within `timeout_s`. The stream
        can be cancelled from another thread (`ChunkStream.cancel`).
        """
        request = store_pb2.GetRequest(
            key=key, layers=list(layers or ()), timeout_s=timeout_s or 0.0, wait_for_key=wait_for_key
        )
        deadline_s = None if timeout_s is None else timeout_s + DEADLINE_GRACE_S
        return ChunkStream(self._stub.Get(request, timeout=deadline_s))

    def lookup(self, key: str) -> KeyInfo | None:
        reply = self._call(
            lambda: self._stub.Lookup(store_pb2.LookupRequest(key=key), timeout=self.timeout_s)
        )
        return key_info_from_proto(reply)

    def longest_match(self, hash_chain: Sequence[bytes]) -> tuple[int, str | None]:
        prefix = store_pb2.PrefixHashes(hashes=list(hash_chain))
        reply = self._call(
            lambda: self._stub.Lookup(store_pb2.LookupRequest(prefix=prefix), timeout=self.timeout_s)
        )
        return (reply.num_units, reply.key) if reply.found else (0, None)

    def register(self, hash_chain: Sequence[bytes], key: str) -> None:
        request = store_pb2.RegisterRequest(key=key, prefix=store_pb2.PrefixHashes(hashes=list(hash_chain)))
        self._call(lambda: self._stub.Register(request, timeout=self.timeout_s))

    def renew(self, key: str, lease_s: float) -> float:
        """Extends `key`'s lease; returns its expiry as unix time."""
        request = store_pb2.RenewRequest(key=key, lease_s=lease_s)
        return self._call(lambda: self._stub.Renew(request, timeout=self.timeout_s)).lease_expiry_unix_s

    def release(self, key: str | None = None, *, owner: str | None = None) -> ReleaseResult:
        if (key is None) == (owner is None):
            raise ValueError("release takes exactly one of key= or owner=")
        request = (
            store_pb2.ReleaseRequest(key=key) if key is not None else store_pb2.ReleaseRequest(owner=owner)
        )
        reply = self._call(lambda: self._stub.Release(request, timeout=self.timeout_s))
        return ReleaseResult(reply.num_keys, reply.num_bytes)

    def stats(self) -> StoreStats:
        return stats_from_proto(
            self._call(lambda: self._stub.Stats(store_pb2.StatsRequest(), timeout=self.timeout_s))
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> StateStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        except ValueError as e:  # grpc's "Cannot invoke RPC on closed channel!"
            if "closed channel" not in str(e):
                raise
            raise StateUnavailableError(f"the client of the store at {self.address} is closed") from None
