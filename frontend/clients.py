"""Async gRPC clients for the workers: one reused channel per address, deadlines on every call.

Channels are created lazily on the event loop that first uses them (grpc.aio channels belong
to one loop). gRPC failures become `GatewayError`s with the status a client should see.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from frontend.errors import GatewayError
from splitserve.rpc import channel_options, make_aio_channel
from splitserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

# The options of every splitserve channel: message limits, and keepalive pings the workers'
# servers accept (splitserve.rpc.server_options), so an idle gateway is never sent GOAWAY.
CHANNEL_OPTIONS = channel_options()

_STATUS_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
}

T = TypeVar("T")
logger = logging.getLogger(__name__)


def rpc_error(exc: grpc.aio.AioRpcError, rpc: str, address: str) -> GatewayError:
    """The gateway error for a failed RPC: 400 / 429 / 503 by gRPC status, else 503."""
    code = exc.code()
    status = _STATUS_BY_CODE.get(code, 503)
    if code == grpc.StatusCode.UNKNOWN:  # an exception escaped a servicer: its text is internal
        logger.warning("%s on %s failed (%s): %s", rpc, address, code.name, exc.details())
        return GatewayError(
            503,
            f"{rpc} on {address} failed ({code.name}); the worker's log has the cause",
            code="worker_error",
        )
    details = exc.details() or code.name
    if status == 400:
        return GatewayError(400, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(503, f"{rpc} on {address} timed out: {details}", code="worker_timeout")
    return GatewayError(status, f"{rpc} on {address} failed ({code.name}): {details}", code="worker_error")


class WorkerClients:
    """Owns the channels to every prefill and decode worker; safe to share across requests.

    Counts the calls in flight on each channel, so `retain` can close the channels of workers
    that left the pools (every restart or resize brings new addresses) once nothing uses them:
    the registry stays as large as the deployment, not as its history.
    """

    def __init__(self, rpc_timeout_s: float = 10.0) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        # each channel's stubs, made once (a stub builds a callable per method)
        self._stubs: dict[str, tuple[prefill_pb2_grpc.PrefillStub, decode_pb2_grpc.DecodeStub]] = {}
        self._num_calls: dict[str, int] = {}  # calls (streams included) in flight, by address

    @property
    def addresses(self) -> set[str]:
        """Addresses with an open channel."""
        return set(self._channels)

    async def retain(self, keep: set[str]) -> int:
        """Close the idle channels of addresses not in `keep`; returns how many were closed."""
        gone = [a for a in self._channels if a not in keep and not self._num_calls.get(a)]
        for address in gone:
            self._num_calls.pop(address, None)
            self._stubs.pop(address, None)
            await self._channels.pop(address).close()
        return len(gone)

    def _begin(self, address: str) -> None:
        self._num_calls[address] = self._num_calls.get(address, 0) + 1

    def _end(self, address: str) -> None:
        self._num_calls[address] = self._num_calls.get(address, 1) - 1

    async def _unary(self, call: Awaitable[T], rpc: str, address: str) -> T:
        self._begin(address)  # no await since the call was made: `retain` cannot have closed it
        try:
            return await _unary(call, rpc, address)
        finally:
            self._end(address)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = make_aio_channel(address)  # carries the cluster token, if this process holds one
            self._channels[address] = channel
        return channel

    def _stubs_of(self, address: str) -> tuple[prefill_pb2_grpc.PrefillStub, decode_pb2_grpc.DecodeStub]:
        stubs = self._stubs.get(address)
        if stubs is None:
            channel = self._channel(address)
            stubs = self._stubs[address] = (
                prefill_pb2_grpc.PrefillStub(channel),
                decode_pb2_grpc.DecodeStub(channel),
            )
        return stubs

    def _decode(self, address: str) -> decode_pb2_grpc.DecodeStub:
        return self._stubs_of(address)[1]

    def _prefill(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        return self._stubs_of(address)[0]

    async def reserve(self, address: str, request: decode_pb2.ReserveRequest) -> decode_pb2.ReserveResponse:
        call = self._decode(address).Reserve(request, timeout=self.rpc_timeout_s)
        return await self._unary(call, "Decode.Reserve", address)

    async def prefill(
        self, address: str, request: prefill_pb2.PrefillRequest, timeout_s: float
    ) -> prefill_pb2.PrefillResponse:
        call = self._prefill(address).Prefill(request, timeout=timeout_s)
        return await self._unary(call, "Prefill.Prefill", address)

    def decode(self, address: str, request: decode_pb2.DecodeRequest, timeout_s: float) -> DecodeStream:
        self._begin(address)
        return DecodeStream(
            self._decode(address).Decode(request, timeout=timeout_s),
            address,
            on_end=lambda: self._end(address),
        )

    async def abort_decode(self, address: str, request_id: str) -> bool:
        request = decode_pb2.AbortDecodeRequest(request_id=request_id)
        call = self._decode(address).Abort(request, timeout=self.rpc_timeout_s)
        return bool((await self._unary(call, "Decode.Abort", address)).found)

    async def abort_prefill(self, address: str, request_id: str) -> bool:
        request = prefill_pb2.AbortPrefillRequest(request_id=request_id)
        call = self._prefill(address).Abort(request, timeout=self.rpc_timeout_s)
        return bool((await self._unary(call, "Prefill.Abort", address)).found)

    async def decode_stats(self, address: str) -> decode_pb2.DecodeStats:
        call = self._decode(address).Stats(decode_pb2.DecodeStatsRequest(), timeout=self.rpc_timeout_s)
        return await self._unary(call, "Decode.Stats", address)

    async def cache_report(
        self, address: str, instance_id: str = "", after_seq: int = 0
    ) -> prefill_pb2.PrefixCacheReport:
        """The worker's prefix events after this reader's cursor (none: a snapshot)."""
        request = prefill_pb2.CacheReportRequest(instance_id=instance_id, after_seq=after_seq)
        call = self._prefill(address).CacheReport(request, timeout=self.rpc_timeout_s)
        return await self._unary(call, "Prefill.CacheReport", address)

    async def serving(self, address: str) -> bool:
        """Whether the worker at `address` answers the standard health check as SERVING (raises
        GatewayError when it cannot be reached)."""
        stub = health_pb2_grpc.HealthStub(self._channel(address))
        call = stub.Check(health_pb2.HealthCheckRequest(), timeout=self.rpc_timeout_s)
        response = await self._unary(call, "Health.Check", address)
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)

    async def store_stats(self, address: str) -> store_pb2.StoreStats:
        stub = store_pb2_grpc.StateStoreStub(self._channel(address))
        call = stub.Stats(store_pb2.StatsRequest(), timeout=self.rpc_timeout_s)
        return await self._unary(call, "StateStore.Stats", address)

    async def release_state(self, store_address: str, key: str) -> int:
        """Frees one stored state (a prefill's that no decode will read); the keys freed."""
        stub = store_pb2_grpc.StateStoreStub(self._channel(store_address))
        call = stub.Release(store_pb2.ReleaseRequest(key=key), timeout=self.rpc_timeout_s)
        return (await self._unary(call, "StateStore.Release", store_address)).num_keys

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        self._stubs = {}
        for channel in channels.values():
            await channel.close()


async def _unary(call: Awaitable[T], rpc: str, address: str) -> T:
    """Await one unary call; a gRPC failure becomes the GatewayError a client should see."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise rpc_error(exc, rpc, address) from exc


class DecodeStream:
    """One Decode call's token stream; `cancel()` ends it from the gateway's side."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, address: str, on_end: Callable[[], None] | None = None
    ) -> None:
        self._call = call
        self.address = address
        self._on_end = on_end  # called once, when the stream ended, failed or was cancelled

    async def read(self) -> decode_pb2.TokenDelta | None:
        """The next delta, or None when the worker ended the stream."""
        try:
            delta = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self._ended()
            raise rpc_error(exc, "Decode.Decode", self.address) from exc
        if delta is grpc.aio.EOF:
            self._ended()
            return None
        return delta

    def cancel(self) -> None:
        self._call.cancel()
        self._ended()

    def _ended(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()
