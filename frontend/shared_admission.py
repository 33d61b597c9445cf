"""One gateway process's side of the deployment's shared admission (`frontend.admission_ledger`).

Used instead of `AdmissionQueue` when the deployment runs several gateway processes
(`GatewaySettings.num_gateways` > 1); the same interface (`acquire` a `Ticket`, `set_capacity`).
The ledger lends this gateway decode slots; a request is admitted at once, with no message, on
slots this gateway holds and no request uses, while the ledger is not contended and none of this
gateway's requests waits there; otherwise it asks the ledger, which admits it, queues it in the
deployment's one FIFO, or refuses it (429 past `max_queued_requests` waiting in the whole
deployment, 400 when it can never fit). A request leaving frees its slots into this gateway's
idle slots, or, while the ledger is contended, back to the ledger at once. Told of contention,
the gateway gives all its idle slots back.

The ledger is reached through a `LedgerClient` (`frontend.ledger_actor` over Ray; in tests, an
in-process one). `attach(client)` (any thread) names the ledger to use, a new one after the old
died: this gateway registers with what its running requests hold, and its waiting requests ask
again there. Until a ledger is attached and registered, requests wait for it (within their
timeout). Runs on the app's event loop, which `start()` names.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from typing import NoReturn, Protocol

from frontend.admission_ledger import Outcome
from frontend.admission_queue import (
    SlotAdmission,
    Ticket,
    never_fits,
    queue_full,
    queue_timeout,
)


class LedgerUnavailable(Exception):
    """The ledger cannot be reached (its process died): wait for the next one to be attached."""


class LedgerClient(Protocol):
    """How one gateway process talks to the ledger; every call is for this gateway's index."""

    async def register(self, held_slots: int) -> None:
        """Say what this gateway holds (its running requests' slots); raises LedgerUnavailable."""

    async def acquire(self, waiter_id: int, num_slots: int) -> Outcome:
        """Ask for `num_slots` for one request; raises LedgerUnavailable."""

    def give_back(self, num_slots: int, reply_to: int = 0) -> None:
        """Return slots (without waiting); `reply_to` is the contention notice this answers."""

    def leave(self, waiter_id: int) -> None:
        """The waiter `waiter_id` gave up (without waiting)."""

    def set_capacity(self, capacity_slots: int | None) -> None:
        """The decode pool's slots as this gateway measured them (without waiting)."""


class SharedAdmissionQueue(SlotAdmission):
    """Owns this gateway's slots lent by the ledger (`held_slots`), those its admitted requests
    use (`num_slots_in_use`; the rest are idle), the count of its requests waiting at the ledger,
    and the contention state the ledger last told it. `max_queued_requests` is the deployment's:
    the ledger enforces it.

    Promises: admits on idle slots only while uncontended and none of its own requests waits
    (so FIFO holds across gateways under contention); gives every idle slot back when told of
    contention and each freed slot while contended; a request that gives up (timeout, client
    gone) leaves the ledger's queue, and slots granted to it in that instant go back.
    """

    def _setup(self) -> None:
        self.held_slots = 0
        self.contended = False
        self._notice_seq = -1
        self._num_waiting = 0
        self._waiter_ids = itertools.count(1)
        self._client: LedgerClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._registered = asyncio.Event()  # the attached ledger knows what this gateway holds
        self._measured = asyncio.Event()  # the pool's capacity is known

    # Wiring -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Run on the app's event loop from now on (its lifespan); register with an attached ledger."""
        self._loop = asyncio.get_running_loop()
        if self._client is not None:
            self._register_soon()

    def attach(self, client: LedgerClient) -> None:
        """Use `client`'s ledger from now on (any thread)."""
        self._client = client
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._register_soon)

    def notice_threadsafe(self, seq: int, contended: bool) -> None:
        """The ledger's contention notice, from any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_notice, seq, contended)

    def _register_soon(self) -> None:
        self._registered.clear()
        self._notice_seq = -1  # a new ledger counts its notices from the start
        assert self._loop is not None
        self._loop.create_task(self._register(self._client))

    async def _register(self, client: LedgerClient | None) -> None:
        if client is None:
            return
        self.held_slots = self.num_slots_in_use  # a new ledger lent none of the idle ones
        try:
            await client.register(self.held_slots)
        except LedgerUnavailable:
            return  # it died already; the next one attached registers anew
        if client is self._client:
            if self.capacity_slots is not None:
                client.set_capacity(self.capacity_slots)
            self._registered.set()

    # The queue's interface --------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        """This gateway's requests waiting at the ledger."""
        return self._num_waiting

    def set_capacity(self, capacity_slots: int | None) -> None:
        """The decode pool's slots as last measured (None or 0: unknown); the ledger hears of a change."""
        capacity_slots = capacity_slots or None
        changed = capacity_slots != self.capacity_slots
        self.capacity_slots = capacity_slots
        self._set_capacity_gauge()
        if capacity_slots is not None:
            self._measured.set()
        if changed and self._client is not None and self._registered.is_set():
            self._client.set_capacity(capacity_slots)

    async def acquire(self, num_slots: int, timeout_s: float) -> Ticket:
        """Admit a request needing `num_slots`, on idle slots or through the ledger, waiting up
        to `timeout_s`. Raises GatewayError 400 (can never fit), 429 (the deployment's queue is
        full) or 503 (waited too long)."""
        start_s = time.monotonic()
        self._refuse_if_never_fits(num_slots)
        if self.measuring:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._measured.wait(), min(self.measuring_wait_s, timeout_s))
        if self._may_use_idle(num_slots):
            return self._admit(num_slots, start_s)
        self._num_waiting += 1
        self._set_depth()
        try:
            remaining_s = max(0.0, timeout_s - (time.monotonic() - start_s))
            outcome = await asyncio.wait_for(self._ask(num_slots), remaining_s)
        except asyncio.TimeoutError:
            self._refuse("queue_timeout", queue_timeout(timeout_s))
        finally:
            self._num_waiting -= 1
            self._set_depth()
        if outcome == "queue_full":
            self._refuse("queue_full", queue_full(self.max_queued_requests, self.max_queued_requests))
        if outcome == "never_fits":
            self._refuse("never_fits", never_fits(num_slots, self.capacity_slots or 0))
        return self._admit(num_slots, start_s)  # granted: `_ask` counted the slots as held

    # Inside -----------------------------------------------------------------------------------

    def _may_use_idle(self, num_slots: int) -> bool:
        return (
            not self.contended
            and not self._num_waiting
            and self._registered.is_set()
            and self.held_slots - self.num_slots_in_use >= num_slots
        )

    async def _ask(self, num_slots: int) -> Outcome:
        """The ledger's answer for one request, asking a newly attached ledger if this one dies."""
        while True:
            await self._registered.wait()
            client = self._client
            assert client is not None
            waiter_id = next(self._waiter_ids)
            pending = asyncio.ensure_future(client.acquire(waiter_id, num_slots))
            try:
                outcome = await asyncio.shield(pending)
            except asyncio.CancelledError:
                client.leave(waiter_id)
                pending.add_done_callback(functools.partial(self._settle_abandoned, client, num_slots))
                raise
            except LedgerUnavailable:
                if client is self._client:
                    self._registered.clear()  # until the controller attaches the next ledger
                continue
            if outcome == "gone":
                continue  # this gateway registered again meanwhile: ask again
            if outcome == "granted":
                self.held_slots += num_slots
            return outcome

    def _settle_abandoned(
        self, client: LedgerClient, num_slots: int, pending: asyncio.Future[Outcome]
    ) -> None:
        """A request gave up while asking: slots granted to it in that instant go back."""
        if pending.cancelled() or pending.exception() is not None:
            return
        if pending.result() == "granted" and client is self._client:
            client.give_back(num_slots)

    def _admit(self, num_slots: int, start_s: float) -> Ticket:
        self._take(num_slots)
        queued_s = time.monotonic() - start_s
        self._observe_queued(queued_s)
        return Ticket(self._give_back, num_slots, queued_s)

    def _give_back(self, num_slots: int) -> None:
        self._untake(num_slots)
        if self.contended and self._client is not None and self._registered.is_set():
            self.held_slots -= num_slots
            self._client.give_back(num_slots)

    def on_notice(self, seq: int, contended: bool) -> None:
        """The ledger says contention started or ended (notices older than the last are stale)."""
        if seq <= self._notice_seq:
            return
        self._notice_seq, self.contended = seq, contended
        if contended and self._client is not None:
            idle = max(0, self.held_slots - self.num_slots_in_use)
            self.held_slots -= idle
            self._client.give_back(idle, reply_to=seq)

    def _refuse(self, reason: str, error: Exception) -> NoReturn:
        self._count_refusal(reason)
        raise error
