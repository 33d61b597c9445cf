"""What one request holds on the workers, and how each piece of it is freed.

Over its life a request holds some of: room reserved on a decode worker (a reservation), a
Reserve whose answer is still due (cancelled while waiting: the worker may grant the room
anyway), a prefill running on a prefill worker, a decode stream, and the handoff's state key in
a store (freed by the decode worker once it read the state; by the gateway when that worker is
lost first). A worker keeps nothing of a request once the gateway aborted it there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

import anyio

from frontend.clients import DecodeStream, WorkerClients
from frontend.errors import GatewayError
from splitserve.v1 import decode_pb2

logger = logging.getLogger(__name__)


class Holdings:
    """Owns what one request holds on workers: the decode worker it is placed on
    (`decode_address`), whether it holds a reservation there, a Reserve whose answer is due, the
    prefill it gave a prompt to (`prefill_address`) and whether that runs still, its decode
    stream, and the handoff's (store address, key).

    Promises: `release` frees all of it and `release_decode` the decode side alone (so a start
    can try again), both shielded from cancellation and never raising (a cleanup that fails is
    logged: the worker's lease frees it). Not safe to drive from two tasks at once."""

    def __init__(self, clients: WorkerClients, request_id: str) -> None:
        self._clients = clients
        self.request_id = request_id
        self.decode_address: str | None = None
        self.holds_reservation = False
        self.prefill_address: str | None = None  # the last prefill worker given the prompt
        self.prefill_in_flight = False
        self.stream: DecodeStream | None = None
        # (store address, key) of the state the decode worker reads and then frees: freed here
        # instead when that worker is lost before it could (a failover that re-prefills)
        self.handoff: tuple[str, str] | None = None
        self._reserve_in_flight: asyncio.Future[decode_pb2.ReserveResponse] | None = None

    def reserved(self, address: str, response: decode_pb2.ReserveResponse) -> None:
        """Decode worker `address` granted room; the state is handed over under `response`'s key."""
        self.decode_address = address
        self.holds_reservation = True
        self.handoff = (response.store_address, response.state_key)

    def reserve_pending(self, address: str, call: asyncio.Future[decode_pb2.ReserveResponse]) -> None:
        """A Reserve on `address` was cancelled while in flight: `release` awaits its answer and
        aborts a room the worker granted, instead of leaving it held until it lapses."""
        self.decode_address, self._reserve_in_flight = address, call

    def prefill_started(self, address: str) -> None:
        self.prefill_address = address
        self.prefill_in_flight = True

    def prefill_ended(self) -> None:
        """The prefill answered or failed there: nothing to abort on its worker."""
        self.prefill_in_flight = False

    def hold_stream(self, address: str, stream: DecodeStream) -> None:
        """The request decodes on `address` through `stream` (a reservation there became it)."""
        self.decode_address, self.stream = address, stream
        self.holds_reservation = False

    def nothing_started(self) -> None:
        """The decode worker refused the stream before starting anything: nothing to abort there."""
        self.stream, self.decode_address = None, None

    def drop_stream(self) -> DecodeStream | None:
        """Cancel the decode stream, if any (its worker holds nothing of it, or is gone); it."""
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.cancel()
        return stream

    async def release_decode(self) -> None:
        """Abort the reservation or the decode stream, if either is still held."""
        stream, self.stream = self.stream, None
        held = self.holds_reservation or stream is not None
        self.holds_reservation = False
        if stream is not None:
            stream.cancel()
        if held and self.decode_address is not None:
            with anyio.CancelScope(shield=True):
                await self.quietly(self._clients.abort_decode(self.decode_address, self.request_id))

    async def drop_lost_decode(self, free_handoff: bool) -> str | None:
        """Decode failover: let go of the lost stream (its worker is gone: nothing to abort
        there) and of a room an earlier failed attempt still holds; free the handoff's state
        when `free_handoff` (the lost worker may not have). The lost worker's address."""
        stream = self.drop_stream()
        await self.release_decode()
        handoff, self.handoff = self.handoff, None
        if handoff is not None and free_handoff:
            await self.release_state(*handoff)
        return stream.address if stream is not None else None

    async def release_state(self, store_address: str, key: str) -> None:
        """Free a stored state nobody will read (sealed or not; a write still on its way is
        refused from then on, so nothing waits for its lease to run out)."""
        with anyio.CancelScope(shield=True):
            await self.quietly(self._clients.release_state(store_address, key))

    @property
    def holds_anything(self) -> bool:
        """Whether `release` has anything to abort or wait for."""
        prefill = self.prefill_in_flight and self.prefill_address is not None
        return (
            self._reserve_in_flight is not None
            or prefill
            or self.holds_reservation
            or self.stream is not None
        )

    async def release(self) -> None:
        """Abort whatever is still held on any worker."""
        if not self.holds_anything:  # a finished request (most): no shielded scope to set up
            return
        with anyio.CancelScope(shield=True):
            if self._reserve_in_flight is not None:  # cancelled mid-Reserve: its answer first
                await asyncio.gather(self._reserve_in_flight, return_exceptions=True)
                self.holds_reservation = True  # an Abort of a room never granted is harmless
            if self.prefill_in_flight and self.prefill_address is not None:
                await self.quietly(self._clients.abort_prefill(self.prefill_address, self.request_id))
            await self.release_decode()

    async def quietly(self, call: Awaitable[object]) -> None:
        """Await a cleanup call; a failure is logged, not raised."""
        try:
            await call
        except GatewayError as exc:
            logger.warning("request %s: cleanup failed: %s", self.request_id, exc.message)
