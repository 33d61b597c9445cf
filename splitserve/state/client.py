"""A Python client of a remote StateStore that speaks the core store's API and raises its errors."""

from __future__ import annotations

import functools
import queue
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from splitserve import rpc
from splitserve.state.chunk import Chunk, StateKind
from splitserve.state.errors import StateUnavailableError
from splitserve.state.records import NO_PREFIX_MATCH, KeyInfo, PrefixMatch, ReleaseResult, StoreStats
from splitserve.state.shm import LocalArena, first_region_bytes
from splitserve.state.spare_region import SpareRegion
from splitserve.state.status import error_from_rpc
from splitserve.state.streams import ChunkStream, PutStream, WarmCall
from splitserve.state.transport import RemoteRegions, TransportClient, TransportEndpoint
from splitserve.state.wire import (
    KIND_TO_PROTO,
    chunk_to_proto,
    key_info_from_proto,
    seal_message,
    stats_from_proto,
)
from splitserve.v1 import common_pb2, store_pb2, store_pb2_grpc

T = TypeVar("T")
DEADLINE_GRACE_S = 5.0  # a Get's own deadline trails the store's timeout, whose error says more


class StateStoreClient:
    """One channel to one store server. Methods mirror `StateStore`'s and raise its errors.

    Owns the channel (`close`, or use as a context manager). Thread-safe: gRPC channels and stubs
    are. Unary calls take `timeout_s`; `put` has no deadline of its own, `open_put` is bounded by
    its `finish`, `get` by its `timeout_s`. With `spare_region`, a finished `open_put` leases the
    next put's first region ahead (`SpareRegion`; off unless asked: it holds a region between puts).
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        max_message_bytes: int = rpc.MAX_MESSAGE_BYTES,
        spare_region: bool = False,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = rpc.make_channel(address, max_message_bytes)
        self._stub = store_pb2_grpc.StateStoreStub(self._channel)
        self._arena: LocalArena | None = None
        self._arena_probe: Path | None = None  # the probe file of the arena last found
        self._arena_checked = False
        self._spare = SpareRegion(self._allocate_spare, self._release_spare) if spare_region else None
        self._warm_calls: queue.SimpleQueue[WarmCall] = queue.SimpleQueue()  # opened ahead (warm_next)
        self._closed = False

    def local_arena(self) -> LocalArena | None:
        """The store's shared-memory arena if this process shares its node (asked once, then
        remembered while its probe file stands), else None: then state moves as bytes over gRPC.
        A store restarted at the same address has a new arena (the old one's files are gone)."""
        if self._arena_checked and self._arena_probe is not None and not self._arena_probe.exists():
            self._arena_checked = False
        if not self._arena_checked:
            info = self._call(lambda: self._stub.Arena(store_pb2.ArenaRequest(), timeout=self.timeout_s))
            self._arena = LocalArena.probe(info.directory, info.probe_name, info.probe_token)
            self._arena_probe = Path(info.directory) / info.probe_name if self._arena is not None else None
            self._arena_checked = True
        return self._arena

    def transfer_engine(self) -> str:
        """The transfer engine the store serves its arena with ("none": readers off its node get
        bytes over gRPC)."""
        info = self._call(lambda: self._stub.Arena(store_pb2.ArenaRequest(), timeout=self.timeout_s))
        return info.transfer_engine or "none"

    def remote_regions(self, transport: TransportClient) -> RemoteRegions | None:
        """The store's arena as `transport` reads it from this node, or None when the store
        serves it with no transfer engine or another one (then the bytes come over gRPC)."""
        info = self._call(lambda: self._stub.Arena(store_pb2.ArenaRequest(), timeout=self.timeout_s))
        if info.transfer_engine != transport.engine:
            return None

        def locate(regions: list[str]) -> dict[str, int]:
            request = store_pb2.ArenaRequest(regions=regions)
            reply = self._call(lambda: self._stub.Arena(request, timeout=self.timeout_s))
            return dict(reply.region_addresses)

        return RemoteRegions(transport, TransportEndpoint(info.transfer_engine, info.transfer_endpoint), locate)

    def allocate(
        self,
        key: str,
        layer: int,
        kind: StateKind | str,
        num_bytes: int,
        *,
        owner: str,
        lease_s: float | None = None,
    ) -> str:
        """A fresh region of `num_bytes` in the store's arena for `key` (created if new); its name.
        (`layer` and `kind` say what it is for; the store does not need them.)"""
        request = self._allocate_request(key, layer, kind, num_bytes, owner, lease_s)
        return self._call(lambda: self._stub.Allocate(request, timeout=self.timeout_s)).region

    @staticmethod
    def _allocate_request(
        key: str, layer: int, kind: StateKind | str, num_bytes: int, owner: str, lease_s: float | None
    ) -> store_pb2.AllocateRequest:
        kind_proto = KIND_TO_PROTO[StateKind(kind)]
        return store_pb2.AllocateRequest(
            key=key, owner=owner, lease_s=lease_s or 0.0, layer=layer, kind=kind_proto, num_bytes=num_bytes
        )

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

    def open_put(
        self,
        key: str,
        *,
        owner: str,
        lease_s: float | None = None,
        shared_memory: bool | None = None,
        expected_bytes: int | None = None,
        hold_bytes: int = 0,
        warm_next: bool = False,
    ) -> PutStream:
        """A Put of `key` that stays open: `write` chunks or `write_state` tensors' bytes as they
        are made, then `finish` or `cancel`. `write_state` pieces go through the store's arena
        when `shared_memory` is True, or None (the default) and the store shares this node;
        `expected_bytes` (the state's total, if known) sizes the first region to hold it all;
        `hold_bytes` groups small pieces into one message (`PutStream`; 0: each goes at once).
        With `warm_next` the next put's PutBatch call is opened (`WarmCall`) once this one is
        acknowledged, on gRPC's channel thread (with `spare_region`, in `finish`), so a writer that
        puts again and again (a prefill worker) starts each put without gRPC's call start-up
        (0.7-0.9 ms) in its request's path; any put of this client takes a call opened ahead."""
        arena = self.local_arena() if shared_memory is not False else None
        if shared_memory and arena is None:
            raise StateUnavailableError(f"the store at {self.address} has no arena this process can map")

        def allocate(key: str, layer: int, kind: StateKind, num_bytes: int) -> str:
            return self.allocate(key, layer, kind, num_bytes, owner=owner, lease_s=lease_s)

        first_region = on_finish = on_acked = None
        if arena is not None and expected_bytes:
            num_bytes = first_region_bytes(expected_bytes)
            spare = self._spare
            first_region = spare.take(num_bytes, owner, arena) if spare is not None else None
            if first_region is None:  # ask now: the round trip overlaps the first layer
                request = self._allocate_request(key, 0, StateKind.KDA_RECURRENT, num_bytes, owner, lease_s)
                pending = self._stub.Allocate.future(request, timeout=self.timeout_s)
                first_region = functools.partial(self._call, lambda: pending.result().region)
            if spare is not None:
                on_finish = functools.partial(self._ready_next_put, spare, num_bytes, owner, arena)
        if on_finish is None and warm_next:
            on_acked = self._warm_next_put  # on gRPC's thread, alongside the ack reaching the writer
        warm_call = self._take_warm_call()

        return PutStream(
            self._stub,
            key,
            owner,
            lease_s,
            arena=arena,
            allocate=allocate,
            expected_bytes=expected_bytes,
            first_region=first_region,
            on_finish=on_finish,
            warm_call=warm_call,
            hold_bytes=hold_bytes,
            on_acked=on_acked,
        )

    def _ready_next_put(self, spare: SpareRegion, num_bytes: int, owner: str, arena: LocalArena) -> None:
        """After a put's ack: a region and a PutBatch call ready for the next one."""
        spare.refill(num_bytes, owner, arena)
        self._warm_next_put()

    def _warm_next_put(self) -> None:
        if self._closed or not self._warm_calls.empty():
            return
        try:
            warm = WarmCall(self._stub)
        except ValueError:  # the channel closed meanwhile
            return
        self._warm_calls.put(warm)
        if self._closed:  # closed meanwhile: `close` may have missed it (its thread waits forever)
            self._close_warm_calls()

    def _close_warm_calls(self) -> None:
        while (warm := self._take_warm_call()) is not None:
            warm.close()  # ends gRPC's thread waiting for its messages

    def _take_warm_call(self) -> WarmCall | None:
        while True:
            try:
                warm = self._warm_calls.get_nowait()
            except queue.Empty:
                return None
            if warm.usable:
                return warm
            warm.close()

    def _allocate_spare(self, key: str, num_bytes: int, owner: str, lease_s: float) -> grpc.Future:
        request = self._allocate_request(key, 0, StateKind.KDA_RECURRENT, num_bytes, owner, lease_s)
        return self._stub.Allocate.future(request, timeout=self.timeout_s)

    def _release_spare(self, key: str) -> grpc.Future:
        return self._stub.Release.future(store_pb2.ReleaseRequest(key=key), timeout=self.timeout_s)

    def seal(self, key: str, *, owner: str) -> None:
        self._call(lambda: self._stub.Put(iter([seal_message(key, owner)]), timeout=self.timeout_s))

    def get(
        self,
        key: str,
        *,
        layers: Collection[int] | None = None,
        timeout_s: float | None = None,
        wait_for_key: bool = False,
        shared_memory: bool | None = None,
        transport: TransportClient | None = None,
    ) -> ChunkStream:
        """Streams `key`'s chunks as they land, until it is sealed; checksums are checked here too.

        With `wait_for_key` a key not yet put is waited for rather than NOT_FOUND. The store fails
        the read with `StateTimeoutError` if the key is not sealed within `timeout_s`. The stream
        can be cancelled from another thread (`ChunkStream.cancel`). Chunks written through the
        store's arena come as read-only memoryviews of it (zero-copy) when `shared_memory` is
        True, or None (the default) and the store shares this node; else, given a `transport`
        the store serves its arena with, pulled through it into buffers of this process; else as
        bytes.
        """
        arena: LocalArena | RemoteRegions | None = self.local_arena() if shared_memory is not False else None
        if shared_memory and arena is None:
            raise StateUnavailableError(f"the store at {self.address} has no arena this process can map")
        if arena is None and transport is not None:
            arena = self.remote_regions(transport)
        request = store_pb2.GetRequest(
            key=key,
            layers=list(layers or ()),
            timeout_s=timeout_s or 0.0,
            wait_for_key=wait_for_key,
            regions=arena is not None,
        )
        deadline_s = None if timeout_s is None else timeout_s + DEADLINE_GRACE_S
        # A reader waiting for a key also waits for a store that is restarting at this address
        # (its channel still backing off), within the deadline, instead of failing at once; other
        # reads have a fallback (compute, re-prefill) and fail fast.
        wait_for_ready = wait_for_key and deadline_s is not None
        call = self._stub.GetBatch(request, timeout=deadline_s, wait_for_ready=wait_for_ready)
        return ChunkStream(call, arena)

    def lookup(self, key: str) -> KeyInfo | None:
        reply = self._call(
            lambda: self._stub.Lookup(store_pb2.LookupRequest(key=key), timeout=self.timeout_s)
        )
        return key_info_from_proto(reply)

    def longest_match(self, hash_chain: Sequence[bytes]) -> tuple[int, str | None]:
        found = self.match_prefix(hash_chain)
        return found.num_units, found.key

    def match_prefix(
        self, hash_chain: Sequence[bytes], token_ids: Sequence[int] | None = None
    ) -> PrefixMatch:
        """The longest prefix of `hash_chain` this store holds a complete state of. With the
        prompt's `token_ids`, states ending inside a unit match too, none longer than them."""
        request = store_pb2.LookupRequest(
            prefix=store_pb2.PrefixHashes(hashes=list(hash_chain)), token_ids=list(token_ids or ())
        )
        reply = self._call(lambda: self._stub.Lookup(request, timeout=self.timeout_s))
        return PrefixMatch(reply.num_units, reply.key, reply.num_tokens) if reply.found else NO_PREFIX_MATCH

    def register(
        self,
        hash_chain: Sequence[bytes],
        key: str,
        *,
        tail_token_ids: Sequence[int] = (),
        num_tokens: int = 0,
    ) -> None:
        """Advertises `key` as the complete state of `hash_chain` (+ `tail_token_ids`, `num_tokens`
        in all); the store then keeps it until it must evict it (see `StateStore.register`)."""
        request = store_pb2.RegisterRequest(
            key=key,
            prefix=store_pb2.PrefixHashes(hashes=list(hash_chain)),
            tail_token_ids=list(tail_token_ids),
            num_tokens=num_tokens,
        )
        self._call(lambda: self._stub.Register(request, timeout=self.timeout_s))

    def renew(self, key: str, lease_s: float, owner: str = "") -> float:
        """Extends `key`'s lease (handing it to `owner`, if given); returns its expiry as unix time."""
        request = store_pb2.RenewRequest(key=key, lease_s=lease_s, owner=owner)
        return self._call(lambda: self._stub.Renew(request, timeout=self.timeout_s)).lease_expiry_unix_s

    def release(self, key: str | None = None, *, owner: str | None = None) -> ReleaseResult:
        if (key is None) == (owner is None):
            raise ValueError("release takes exactly one of key= or owner=")
        if owner is not None and self._spare is not None:
            self._spare.forget()  # the store frees it with the owner's other keys
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
        self._closed = True  # before closing what is queued: a warm call opened after sees it
        self._close_warm_calls()
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
