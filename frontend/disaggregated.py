"""The disaggregated start: room reserved on a decode worker, the prompt prefilled on a prefill worker.

The state takes one hop: the reservation names the prefill's node store (`source_store`), the
prefill writes there and the decode worker reads from there. When that store is known, the pool
is not colocated and the best decode worker is believed to have room, the gateway names the
state key itself and the prefill starts at once, the reservation beside it (so neither the
Reserve's round trip nor a busy decode engine's step is in the TTFT). A colocated worker holds
the room first and prefills into it. `max_tokens: 1` needs no decode worker at all.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import TYPE_CHECKING

import grpc

from frontend.errors import GatewayError, over_capacity
from splitserve.v1 import decode_pb2, prefill_pb2
from splitserve.wire import prefill_request, sampling_params_to_proto

if TYPE_CHECKING:
    from frontend.generate import Generation


class DecodeUnreachable(GatewayError):
    """No decode worker could be reached for a reservation (the pool's workers are dead or being
    restarted): the request may wait for one (`decode_failover_wait_s`)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="service_unavailable")


class PrefillLost(GatewayError):
    """A prefill failed because its worker, or the store it writes to, could not be reached:
    nothing reached the client yet, so the prompt may run elsewhere."""

    def __init__(self, address: str, cause: GatewayError) -> None:
        super().__init__(cause.status_code, cause.message, code=cause.code)
        self.address = address


async def reserve_and_prefill(
    gen: Generation, prefill_address: str, candidates: list[str]
) -> prefill_pb2.PrefillResponse:
    """Room on the first of the decode `candidates` that grants it, and the prefill's answer."""
    source_store = gen.p.router.store_of(prefill_address)
    if gen.params.max_tokens == 1:
        # One token is all the prefill makes: no decode room to reserve, nor an Abort to free it.
        return await prefill(gen, prefill_address, None)
    if _may_reserve_alongside(gen, candidates, source_store):
        return await _prefill_while_reserving(gen, prefill_address, candidates, source_store)
    reservation = await _reserve(gen, candidates, source_store)
    reserved_on = gen.held.decode_address
    if reserved_on is not None and reserved_on in gen.p.router.prefill_addresses:
        prefill_address = reserved_on  # colocated: the engine holding the room prefills
    return await prefill(gen, prefill_address, reservation)


def _may_reserve_alongside(gen: Generation, candidates: list[str], source_store: str) -> bool:
    """Whether the prefill may start before the reservation is granted: the prefill's node
    store is known (the key can be named here), no candidate prefills itself (a colocated
    worker must hold the room first) and the first candidate is believed to have room (so a
    full decode pool refuses requests before their prefill, not after)."""
    if not source_store:
        return False
    if any(address in gen.p.router.prefill_addresses for address in candidates):
        return False
    return gen.p.router.decode_has_room(candidates[0])


async def _prefill_while_reserving(
    gen: Generation, prefill_address: str, candidates: list[str], source_store: str
) -> prefill_pb2.PrefillResponse:
    """The prefill starts at once, writing into its own node's store under a key named here
    (one per attempt); the reservation runs beside it, so its round trip (and, on a busy
    decode worker, its wait for the engine's step) leaves the TTFT. A reservation refused
    everywhere aborts the prefill, releases the key in the store and answers as before
    (429/503)."""
    key = f"decode/{gen.request_id}/{secrets.token_hex(8)}"  # shaped like a decode worker's own
    # the prefill records itself as the state's owner: the writer until the decode reads it
    target = decode_pb2.ReserveResponse(accepted=True, store_address=source_store, state_key=key)
    prefilling = asyncio.ensure_future(prefill(gen, prefill_address, target))
    try:
        await _reserve(gen, candidates, source_store, key)
    except BaseException:
        prefilling.cancel()  # release() aborts it on the worker (it is still in flight)
        await asyncio.gather(prefilling, return_exceptions=True)
        await gen.held.release_state(source_store, key)  # nobody will read it
        raise
    return await prefilling


async def _reserve(
    gen: Generation, candidates: list[str], source_store: str = "", state_key: str = ""
) -> decode_pb2.ReserveResponse:
    """Reserve room on the first candidate that grants it. The state goes to `source_store`
    (the prefill worker's node store: it writes there, the decode reads from there, one hop);
    "" leaves it to the decode worker's own store, as for a colocated worker. `state_key`:
    the key a prefill already running writes under ("" lets the decode worker name it)."""
    router = gen.p.router
    request = decode_pb2.ReserveRequest(
        request_id=gen.request_id,
        num_prompt_tokens=len(gen.prompt_ids) + len(gen.resumed_ids),  # the state's tokens
        timeout_s=gen.p.settings.reserve_timeout_s,
        state_key=state_key,
        num_samples=gen.params.num_samples,
    )
    if gen.params.max_tokens is not None:
        request.max_tokens = gen.params.max_tokens
    rejections: list[str] = []
    failures: list[str] = []
    for address in candidates:
        colocated = address in router.prefill_addresses  # it prefills into its own store
        request.source_store_address = "" if colocated else source_store
        try:
            response = await _reserve_on(gen, address, request)
        except GatewayError as exc:
            if exc.status_code != 503:
                raise
            failures.append(exc.message)
            await gen.p.probe(address)  # unreachable: not ranked again until it answers
            continue
        if response.accepted:
            gen.held.reserved(address, response)
            for _ in range(gen.params.num_samples):
                router.on_decode_reserved(address)
            gen.p.on_route(response.store_address)
            return response
        rejections.append(f"{address}: {response.reject_reason or 'rejected'}")
    if rejections:
        raise over_capacity("every decode worker is full (" + "; ".join(rejections) + "); retry later")
    raise DecodeUnreachable("no decode worker could be reached: " + "; ".join(failures))


async def _reserve_on(
    gen: Generation, address: str, request: decode_pb2.ReserveRequest
) -> decode_pb2.ReserveResponse:
    """One Reserve. Cancelled while in flight (a sibling prompt failed, the client left), the
    call still runs to its answer, so release() aborts a room the worker granted instead of
    leaving it held until it lapses (2 x reserve_timeout_s)."""
    call = asyncio.ensure_future(gen.p.clients.reserve(address, request))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        gen.held.reserve_pending(address, call)
        raise


async def prefill(
    gen: Generation, address: str, reservation: decode_pb2.ReserveResponse | None
) -> prefill_pb2.PrefillResponse:
    """The prompt (and, after a failover, the tokens sent) prefilled on `address`, its state
    written where `reservation` says; `PrefillLost` when the worker or its store is unreachable."""
    router = gen.p.router
    request = prefill_request(
        gen.request_id,
        gen.prompt_ids,
        sampling_params_to_proto(gen.params),
        reservation,
        gen.p.settings.state_lease_s,
        gen.prefix_hashes,
    )
    request.output_token_ids.extend(gen.resumed_ids)
    gen.held.prefill_started(address)
    router.on_prefill_start(address, len(gen.prompt_ids))
    router.on_prefix_sent(address, gen.prefix_hashes)
    try:
        response = await gen.p.clients.prefill(address, request, gen.remaining_s())
        gen.held.prefill_ended()
        return response
    except GatewayError as exc:
        gen.held.prefill_ended()  # it failed there: nothing to abort
        cause = exc.__cause__  # UNAVAILABLE: the worker or its store unreachable (a crash
        # of the worker on this prompt is UNKNOWN or INTERNAL, and would crash elsewhere too)
        if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.UNAVAILABLE:
            raise PrefillLost(address, exc) from exc
        raise
    finally:
        router.on_prefill_end(address, len(gen.prompt_ids))
