"""An instant worker: a test double for measuring the gateway, never a model server.

It serves the real `splitserve.v1.Prefill` and `splitserve.v1.Decode` services on one gRPC
server (grpc.aio, so a stream costs no thread) and does no work at all: Reserve accepts at
once, Prefill returns the first token at once, Decode streams the rest as fast as the server
can write, CacheReport tells of an empty prefix cache. Whatever time a client measures through
the gateway beyond what it measures against this worker directly is the gateway's.

Tokens are deterministic and prompt-derived: output position i (the prefill's token is 0) is
prompt token `i mod len(prompt)`. `max_tokens`, `ignore_eos`, `stop_token_ids` and
`eos_token_id` are honoured, so a request ends when a real worker's would; no other sampling
parameter changes anything. Stats report a nearly empty worker with room for a million
sequences, so the gateway's router always finds it healthy and free. Reservations never lapse.
Reserve names the worker itself as the state store; of the StateStore service it answers only
Stats (an empty memory tier), the one store call the gateway makes.

`serve()` starts one on the running event loop; `instant_worker_process()` runs one in a child
process (its own interpreter and GIL, as a real worker has).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import grpc

from experiments.server_process import ServerProcess, wait_until_told
from splitserve.rpc import format_address, server_options
from splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

CAPACITY = 1_000_000  # sequences, state slots and KV blocks the Stats claim
EMPTY_PROMPT_TOKEN_ID = 0  # what an empty prompt "generates"


@dataclass(frozen=True)
class InstantConfig:
    """How the instant worker answers: tokens per Decode delta, the EOS id, the context limit."""

    tokens_per_delta: int = 1
    eos_token_id: int | None = None  # None: only max_tokens and stop_token_ids end a request
    max_model_len: int = 1 << 20  # ends a request that sets no max_tokens

    def __post_init__(self) -> None:
        if self.tokens_per_delta < 1:
            raise ValueError(f"tokens_per_delta must be at least 1 (got {self.tokens_per_delta})")


def output_token(prompt_token_ids: list[int], position: int) -> int:
    """The token at output `position` (0 = the prefill's) for this prompt."""
    if not prompt_token_ids:
        return EMPTY_PROMPT_TOKEN_ID
    return prompt_token_ids[position % len(prompt_token_ids)]


@dataclass
class InstantWorker(
    prefill_pb2_grpc.PrefillServicer, decode_pb2_grpc.DecodeServicer, store_pb2_grpc.StateStoreServicer
):
    """The services' handlers on one event loop; owns the sets of reserved and running requests.

    It is its own state store too, for the gateway's load monitor, which reads Stats from every
    store a reservation names; a store that did not answer would cost the gateway failing RPCs.
    """

    config: InstantConfig = field(default_factory=InstantConfig)
    store_address: str = ""  # named by Reserve: this server, whose StateStore answers only Stats
    reserved: set[str] = field(default_factory=set)
    running: set[str] = field(default_factory=set)

    # Decode ------------------------------------------------------------------------------------

    async def Reserve(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.reserved.add(request.request_id)
        return decode_pb2.ReserveResponse(
            accepted=True,
            store_address=self.store_address,
            state_key=f"instant-{request.request_id}",
            state_owner="instant-worker",
            expiry_unix_s=time.time() + (request.timeout_s or 60.0),
        )

    async def Decode(self, request, context) -> AsyncIterator[decode_pb2.TokenDelta]:  # type: ignore[no-untyped-def]  # noqa: N802
        request_id = request.request_id
        self.reserved.discard(request_id)
        self.running.add(request_id)
        try:
            for delta in self._deltas(request):
                if request_id not in self.running:  # aborted
                    yield decode_pb2.TokenDelta(
                        request_id=request_id, finish_reason=common_pb2.FINISH_REASON_ABORT
                    )
                    return
                delta.timing.emit_unix_s = time.time()
                yield delta
        finally:
            self.running.discard(request_id)

    def _deltas(self, request: decode_pb2.DecodeRequest) -> Iterator[decode_pb2.TokenDelta]:
        """Positions 1.. in deltas of `tokens_per_delta`; the last one carries the finish reason."""
        prompt, params = list(request.prompt_token_ids), request.sampling_params
        end = self._end(len(prompt), params)
        position = 1  # the prefill sampled position 0
        while True:
            delta = decode_pb2.TokenDelta(request_id=request.request_id)
            for _ in range(min(self.config.tokens_per_delta, end - position)):
                token = output_token(prompt, position)
                delta.token_ids.append(token)
                position += 1
                if self._stops(token, params):
                    delta.finish_reason = common_pb2.FINISH_REASON_STOP
                    delta.stop_token_id = token
                    break
            if not delta.finish_reason and position >= end:
                delta.finish_reason = common_pb2.FINISH_REASON_LENGTH
            delta.num_generated_tokens = position
            yield delta
            if delta.finish_reason:
                return

    async def Abort(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        """Both services' Abort: `found` when the request was reserved, prefilling or decoding."""
        request_id = request.request_id
        found = request_id in self.reserved or request_id in self.running
        self.reserved.discard(request_id)
        self.running.discard(request_id)
        if isinstance(request, prefill_pb2.AbortPrefillRequest):
            return prefill_pb2.AbortPrefillResponse(found=found)
        return decode_pb2.AbortDecodeResponse(found=found)

    async def Stats(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        """Decode and StateStore Stats; a nearly empty worker either way."""
        if isinstance(request, store_pb2.StatsRequest):
            return store_pb2.StoreStats(
                tiers=[store_pb2.TierStats(name="memory", capacity_bytes=CAPACITY << 20)]
            )
        num_in_use = len(self.running) + len(self.reserved)
        return decode_pb2.DecodeStats(
            num_running_seqs=len(self.running),
            num_reserved=len(self.reserved),
            max_num_seqs=CAPACITY,
            num_free_kv_blocks=CAPACITY - num_in_use,
            num_total_kv_blocks=CAPACITY,
            num_free_state_slots=CAPACITY - num_in_use,
            num_total_state_slots=CAPACITY,
        )

    # Prefill -----------------------------------------------------------------------------------

    async def Prefill(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        arrival_unix_s = time.time()
        prompt = list(request.prompt_token_ids)
        params = request.sampling_params
        first = output_token(prompt, 0)
        response = prefill_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=first,
            num_prompt_tokens=len(prompt),
            timing=prefill_pb2.PrefillTiming(arrival_unix_s=arrival_unix_s),
        )
        if self._stops(first, params):
            response.finish_reason = common_pb2.FINISH_REASON_STOP
            response.stop_token_id = first
        elif self._end(len(prompt), params) <= 1:
            response.finish_reason = common_pb2.FINISH_REASON_LENGTH
        else:
            response.state.CopyFrom(
                common_pb2.StateHandle(
                    store_address=request.store_address,
                    key=request.state_key,
                    owner=request.state_owner,
                    num_layers=1,
                    lease_expiry_unix_s=arrival_unix_s + 60.0,
                )
            )
        return response

    async def CacheReport(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        """An empty prefix cache, as a snapshot: the prefix-aware router polls every prefill worker."""
        return prefill_pb2.PrefixCacheReport(instance_id="instant-worker", snapshot=True)

    # Rules -------------------------------------------------------------------------------------

    def _end(self, num_prompt_tokens: int, params: common_pb2.SamplingParams) -> int:
        """How many tokens the request may produce in all, the prefill's included."""
        room = max(self.config.max_model_len - num_prompt_tokens, 1)
        return min(params.max_tokens, room) if params.HasField("max_tokens") else room

    def _stops(self, token: int, params: common_pb2.SamplingParams) -> bool:
        is_eos = token == self.config.eos_token_id and not params.ignore_eos
        return is_eos or token in params.stop_token_ids


async def serve(
    host: str = "127.0.0.1", port: int = 0, config: InstantConfig | None = None
) -> tuple[grpc.aio.Server, str]:
    """Start an instant worker on this event loop; returns the server and its "host:port"."""
    worker = InstantWorker(config or InstantConfig())
    server = grpc.aio.server(options=server_options())
    prefill_pb2_grpc.add_PrefillServicer_to_server(worker, server)
    decode_pb2_grpc.add_DecodeServicer_to_server(worker, server)
    store_pb2_grpc.add_StateStoreServicer_to_server(worker, server)
    bound = server.add_insecure_port(format_address(host, port))
    if bound == 0:
        raise OSError(f"could not bind the instant worker to {format_address(host, port)}")
    worker.store_address = format_address(host, bound)
    await server.start()
    return server, worker.store_address


def _serve_until_told(conn: Connection, host: str, port: int, config: InstantConfig) -> None:
    """The child process's body: serve, send the address up the pipe, stop when told."""

    async def run() -> None:
        server, address = await serve(host, port, config)
        conn.send(address)
        try:
            await asyncio.get_running_loop().run_in_executor(None, wait_until_told, conn)
        finally:
            await server.stop(grace=1.0)

    asyncio.run(run())


def instant_worker_process(
    config: InstantConfig | None = None, host: str = "127.0.0.1", port: int = 0
) -> ServerProcess:
    """An instant worker in its own process (not started); `with` it, or `start()` and `stop()`."""
    return ServerProcess(_serve_until_told, (host, port, config or InstantConfig()), "instant worker")
