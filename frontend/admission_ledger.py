"""The deployment's admission across several gateway processes: one ledger of the decode pool's
slots and one FIFO queue in front of it.

With one gateway, `frontend.admission_queue.AdmissionQueue` keeps both in the gateway. With
several (`gateway.replicas`, `gateway.placement: every_node`), each gateway process holds slots
*lent* by this ledger (`frontend.shared_admission`): a request admitted on slots its gateway
already holds costs no message; one that finds none asks the ledger, which admits it from the
slots no gateway holds or queues it in the one FIFO, capped at `max_queued_requests` for the
whole deployment. So the pool's slots and the queue cap hold across every gateway, as with one.

Slots a gateway holds but no request uses ("idle") are its to reuse until the ledger is
contended (a request waits, or the pool shrank under what is lent): the ledger then tells every
gateway (`notice(seq, contended)`), each gives its idle slots back at once and every slot it
frees from then on, and uses no idle slot of its own, so waiting requests go in FIFO order
across gateways. A request is refused for a full queue only after every gateway told has given
its idle slots back (or `reclaim_wait_s` passed), so idle slots elsewhere never cause a 429.

A gateway that (re)starts registers with what it holds (0 for a new process), which drops what
the ledger believed of its predecessor, and its waiters. A ledger that restarts knows nothing
lent: built with `recovering_from` (the gateways that may hold slots), it grants nothing until
each has registered again with what it holds, or `recovery_s` passed.

Runs on one event loop (the ledger actor's); plain asyncio, no Ray, so tests drive it in-process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

# What an `acquire` comes to: admitted; refused (the queue is full, or the request needs more
# slots than the pool has); or ended without admission (its gateway left it, or re-registered).
Outcome = Literal["granted", "queue_full", "never_fits", "left", "gone"]
Notice = Callable[[int, bool], None]  # tells one gateway (sequence number, contended)

RECLAIM_WAIT_S = 2.0  # the longest a refusal waits for the gateways to give idle slots back
RECOVERY_S = 10.0  # the longest a restarted ledger waits for the gateways to say what they hold


@dataclass(eq=False)
class _Waiter:
    gateway: int
    waiter_id: int
    num_slots: int
    outcome: asyncio.Future[Outcome]


class AdmissionLedger:
    """Owns the slots lent to each gateway (`held`, by gateway index), the deployment's FIFO of
    requests waiting for slots, and the contention state the gateways are told of.

    Promises: never lends past `capacity_slots` (unknown capacity: lends on, as one gateway
    admits while nothing is measured); admits waiters in arrival order, whichever gateway they
    came from; refuses `queue_full` only with `max_queued_requests` waiting after every gateway
    told has given its idle slots back (or `reclaim_wait_s` passed); `never_fits` when a request
    needs more slots than the whole pool has.
    """

    def __init__(
        self,
        max_queued_requests: int,
        recovering_from: Iterable[int] = (),
        reclaim_wait_s: float = RECLAIM_WAIT_S,
        recovery_s: float = RECOVERY_S,
    ) -> None:
        self.epoch = uuid.uuid4().hex  # a restarted ledger has another
        self.max_queued_requests = max_queued_requests
        self.reclaim_wait_s = reclaim_wait_s
        self.capacity_slots: int | None = None
        self.held: dict[int, int] = {}
        self._notices: dict[int, Notice] = {}
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self.contended = False
        self._seq = 0  # of the last contention notice
        self._unreplied: set[int] = set()  # gateways told "contended" that have not given back yet
        self._replied = asyncio.Event()
        self._replied.set()
        self._num_reclaiming = 0  # refusals waiting for idle slots to come back
        self._recovering = set(recovering_from)
        self._recovery_ends_s = time.monotonic() + recovery_s
        self._recovery_timer: asyncio.TimerHandle | None = None

    # Gateways ---------------------------------------------------------------------------------

    def register(self, gateway: int, held_slots: int, notice: Notice | None = None) -> str:
        """Gateway `gateway` holds `held_slots` (a new process: 0); what the ledger believed it
        held and its waiters go. `notice` tells it of contention from now on. Returns the epoch."""
        self._drop_waiters(gateway)
        self.held[gateway] = max(0, held_slots)
        if notice is not None:
            self._notices[gateway] = notice
            notice(self._seq, self.contended)
        self._recovering.discard(gateway)
        self._replied_by(gateway)
        self._admit()
        return self.epoch

    def forget(self, gateway: int) -> None:
        """Gateway `gateway` is gone for good (or until it registers again): nothing held, no waiter."""
        self._drop_waiters(gateway)
        self.held.pop(gateway, None)
        self._notices.pop(gateway, None)
        self._recovering.discard(gateway)
        self._replied_by(gateway)
        self._admit()

    def set_capacity(self, capacity_slots: int | None) -> None:
        """The decode pool's slots, as a gateway last measured them (None or 0: unknown)."""
        self.capacity_slots = capacity_slots or None
        self._admit()

    # Requests ---------------------------------------------------------------------------------

    async def acquire(self, gateway: int, waiter_id: int, num_slots: int) -> Outcome:
        """Lend `num_slots` to `gateway` for one request, now or in FIFO order; or refuse."""
        if self.capacity_slots is not None and num_slots > self.capacity_slots:
            return "never_fits"
        if not self._waiters and self._may_lend(num_slots):
            self._lend(gateway, num_slots)
            return "granted"
        if len(self._waiters) >= self.max_queued_requests:
            await self._reclaim_idle()  # idle slots elsewhere may admit waiters, or this one
            if not self._waiters and self._may_lend(num_slots):
                self._lend(gateway, num_slots)
                return "granted"
            if len(self._waiters) >= self.max_queued_requests:
                return "queue_full"
        waiter = _Waiter(gateway, waiter_id, num_slots, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._update_contention()
        return await waiter.outcome

    def give_back(self, gateway: int, num_slots: int, reply_to: int = 0) -> None:
        """`gateway` no longer holds `num_slots`; `reply_to` is the contention notice it answers."""
        if gateway in self.held:
            self.held[gateway] = max(0, self.held[gateway] - num_slots)
        if reply_to and reply_to == self._seq:
            self._replied_by(gateway)
        self._admit()

    def leave(self, gateway: int, waiter_id: int) -> None:
        """A waiter gives up (its client left, or it timed out); nothing if it is not waiting."""
        for waiter in self._waiters:
            if waiter.gateway == gateway and waiter.waiter_id == waiter_id:
                self._waiters.remove(waiter)
                waiter.outcome.set_result("left")
                self._admit()  # a large head leaving may let the next ones in
                return

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def num_lent(self) -> int:
        return sum(self.held.values())

    # Inside -----------------------------------------------------------------------------------

    def _may_lend(self, num_slots: int) -> bool:
        if self._recovering:
            wait_s = self._recovery_ends_s - time.monotonic()
            if wait_s > 0:  # a gateway may still hold slots this ledger does not know of
                if self._recovery_timer is None:  # then lend whatever the silent ones hold
                    self._recovery_timer = asyncio.get_running_loop().call_later(wait_s, self._admit)
                return False
            self._recovering.clear()
        if self.capacity_slots is None:
            return True
        return self.num_lent + num_slots <= self.capacity_slots

    def _lend(self, gateway: int, num_slots: int) -> None:
        self.held[gateway] = self.held.get(gateway, 0) + num_slots

    def _admit(self) -> None:
        """Admit from the head while it fits; a head that can no longer ever fit is refused."""
        while self._waiters:
            head = self._waiters[0]
            if self.capacity_slots is not None and head.num_slots > self.capacity_slots:
                self._waiters.popleft()
                head.outcome.set_result("never_fits")
                continue
            if not self._may_lend(head.num_slots):
                break
            self._waiters.popleft()
            self._lend(head.gateway, head.num_slots)
            head.outcome.set_result("granted")
        self._update_contention()

    async def _reclaim_idle(self) -> None:
        """Have every gateway give its idle slots back (contention, even with nobody waiting: a
        queue of 0), waiting up to `reclaim_wait_s` for their replies."""
        self._num_reclaiming += 1
        try:
            self._update_contention()
            if self._unreplied:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._replied.wait(), self.reclaim_wait_s)
        finally:
            self._num_reclaiming -= 1
        self._admit()

    def _update_contention(self) -> None:
        """Tell every gateway when contention starts or ends; from its start, await each's reply."""
        over = self.capacity_slots is not None and self.num_lent > self.capacity_slots
        contended = bool(self._waiters) or over or self._num_reclaiming > 0
        if contended == self.contended:
            return
        self.contended = contended
        self._seq += 1
        self._unreplied = set(self._notices) if contended else set()
        if self._unreplied:
            self._replied.clear()
        else:
            self._replied.set()
        for gateway, notice in list(self._notices.items()):
            try:
                notice(self._seq, contended)
            except Exception:  # a gateway that cannot be told is restarted by the controller
                logger.warning("could not tell gateway %d of contention", gateway, exc_info=True)
                self._replied_by(gateway)

    def _replied_by(self, gateway: int) -> None:
        self._unreplied.discard(gateway)
        if not self._unreplied:
            self._replied.set()

    def _drop_waiters(self, gateway: int) -> None:
        for waiter in [w for w in self._waiters if w.gateway == gateway]:
            self._waiters.remove(waiter)
            waiter.outcome.set_result("gone")
