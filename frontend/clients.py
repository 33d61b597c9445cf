"""Async gRPC clients for the workers: one reused channel per address, deadlines on every call.

Channels are created lazily on the event loop that first uses them (grpc.aio channels belong
to one loop). gRPC failures become `GatewayError`s with the status a client should see.
"""

from __future__ import annotations

import grpc

from frontend.errors import GatewayError
from splitserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

_STATUS_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
}


def rpc_error(exc: grpc.aio.AioRpcError, rpc: str, address: str) -> GatewayError:
    """The gateway error for a failed RPC: 400 / 429 / 503 by gRPC status, else 503."""
    code = exc.code()
    status = _STATUS_BY_CODE.get(code, 503)
    details = exc.details() or code.name
    if status == 400:
        return GatewayError(400, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(503, f"{rpc} on {address} timed out: {details}", code="worker_timeout")
    return GatewayError(status, f"{rpc} on {address} failed ({code.name}): {details}", code="worker_error")


class WorkerClients:
    """Owns the channels to every prefill and decode worker; safe to share across requests."""

    def __init__(self, rpc_timeout_s: float = 10.0) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    def _decode(self, address: str) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self._channel(address))

    def _prefill(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(self._channel(address))

    async def reserve(self, address: str, request: decode_pb2.ReserveRequest) -> decode_pb2.ReserveResponse:
        try:
            return await self._decode(address).Reserve(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "Decode.Reserve", address) from exc

    async def prefill(
        self, address: str, request: prefill_pb2.PrefillRequest, timeout_s: float
    ) -> prefill_pb2.PrefillResponse:
        try:
            return await self._prefill(address).Prefill(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "Prefill.Prefill", address) from exc

    def decode(self, address: str, request: decode_pb2.DecodeRequest, timeout_s: float) -> DecodeStream:
        return DecodeStream(self._decode(address).Decode(request, timeout=timeout_s), address)

    async def abort_decode(self, address: str, request_id: str) -> bool:
        request = decode_pb2.AbortDecodeRequest(request_id=request_id)
        try:
            response = await self._decode(address).Abort(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "Decode.Abort", address) from exc
        return bool(response.found)

    async def abort_prefill(self, address: str, request_id: str) -> bool:
        request = prefill_pb2.AbortPrefillRequest(request_id=request_id)
        try:
            response = await self._prefill(address).Abort(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "Prefill.Abort", address) from exc
        return bool(response.found)

    async def decode_stats(self, address: str) -> decode_pb2.DecodeStats:
        try:
            request = decode_pb2.DecodeStatsRequest()
            return await self._decode(address).Stats(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "Decode.Stats", address) from exc

    async def store_stats(self, address: str) -> store_pb2.StoreStats:
        try:
            stub = store_pb2_grpc.StateStoreStub(self._channel(address))
            return await stub.Stats(store_pb2.StatsRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "StateStore.Stats", address) from exc

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()


class DecodeStream:
    """One Decode call's token stream; `cancel()` ends it from the gateway's side."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, address: str) -> None:
        self._call = call
        self.address = address

    async def read(self) -> decode_pb2.TokenDelta | None:
        """The next delta, or None when the worker ended the stream."""
        try:
            delta = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "Decode.Decode", self.address) from exc
        return None if delta is grpc.aio.EOF else delta

    def cancel(self) -> None:
        self._call.cancel()
