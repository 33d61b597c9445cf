"""Admission by decode room: a bounded FIFO queue in front of the decode pool.

Every generation request needs one decode slot per prompt (a KDA state slot on some decode
worker) for as long as it runs. The queue keeps a ledger of the slots this gateway's admitted
requests hold against the pool's capacity (the sum of every decode worker's slots, from the
load monitor's `Decode.Stats`). A request that fits is admitted at once; one that does not waits
in FIFO order and is admitted the moment room frees: a request that held slots releases them, or
the pool grows (a Stats refresh shows more room). Only past `max_queued_requests` waiting does a
request get 429 (with `Retry-After`); a request that needs more slots than the whole pool holds
can never run and gets 400 saying so. Either refusal happens before any worker is touched, so a
refusal holds nothing anywhere.

While decode workers are listed (`decode_listed()`) but none has answered Stats yet (just after
the deployment starts, or after every decode worker was replaced: `measuring`), a request waits
in the FIFO for that first answer, up to `measuring_wait_s`, instead of being admitted blind: a
burst that arrives then queues rather than meeting the workers' own refusals (429 "every decode
worker is full"). While the capacity is unknown otherwise (no decode worker listed), or once that
wait is over, requests are admitted and the pipeline's own errors apply (503 with no worker).
Runs on the app's event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from frontend.errors import RETRY_AFTER_S, GatewayError, over_capacity
from frontend.metrics import GatewayMetrics
from frontend.series import Counter, Gauge, Histogram

logger = logging.getLogger(__name__)

MEASURING_WAIT_S = 5.0  # the longest a request waits for a listed decode pool's first Stats
_QUEUED_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class QueueMetrics:
    """The queue's series, on the gateway's registry: depth, seconds queued, refusals by reason."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.model_name = metrics.model_name
        self.registry = registry = metrics.registry
        self.depth = Gauge(
            "splitserve_admission_queue_depth",
            "Requests waiting for decode room",
            ["model_name"],
            registry=registry,
        )
        self.queued_s = Histogram(
            "splitserve_admission_queue_seconds",
            "Time a request waited for decode room before admission (0 when admitted at once)",
            ["model_name"],
            buckets=_QUEUED_BUCKETS_S,
            registry=registry,
        )
        self.refusals = Counter(
            "splitserve_admission_refusals",
            "Requests refused by admission: queue_full (429), never_fits (400), queue_timeout (503)",
            ["model_name", "reason"],
            registry=registry,
        )
        self.in_use = Gauge(
            "splitserve_admission_slots_in_use",
            "Decode slots held by admitted requests (the queue's ledger)",
            ["model_name"],
            registry=registry,
        )
        self.capacity = Gauge(
            "splitserve_admission_slots_capacity",
            "Decode slots of the whole decode pool, as its workers last reported",
            ["model_name"],
            registry=registry,
        )
        # The refusal reasons exist from the start, so a dashboard sees zeros, not gaps.
        for reason in ("queue_full", "never_fits", "queue_timeout"):
            self.refusals.labels(self.model_name, reason)


@dataclass(eq=False)
class Ticket:
    """The slots one admitted request holds; `release()` gives them back (idempotent)."""

    give_back: Callable[[int], None]  # its queue's: takes the slots back
    num_slots: int
    queued_s: float = 0.0
    released: bool = field(default=False)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.give_back(self.num_slots)


def queue_full(num_waiting: int, max_queued_requests: int) -> GatewayError:
    """The 429 for a request that finds `max_queued_requests` already waiting."""
    return over_capacity(
        f"the decode pool is full and {num_waiting} requests are already waiting "
        f"(gateway.max_queued_requests = {max_queued_requests}); retry after {RETRY_AFTER_S} s"
    )


def never_fits(num_slots: int, capacity_slots: int) -> GatewayError:
    """The 400 for a request needing more slots than the whole decode pool has."""
    return GatewayError(
        400,
        f"this request needs {num_slots} decode slots (one per prompt and choice) but the whole "
        f"decode pool holds {capacity_slots}; send at most {capacity_slots} prompts per request",
        code="request_too_large",
    )


def queue_timeout(timeout_s: float) -> GatewayError:
    """The 503 for a request that waited `timeout_s` in the queue without being admitted."""
    return GatewayError(
        503,
        f"no decode room freed within {timeout_s:g} s of waiting in the admission queue; retry later",
        code="queue_timeout",
    )


@dataclass(eq=False)
class _Waiter:
    num_slots: int
    admitted: asyncio.Future[None]


class SlotAdmission(ABC):
    """What every admission queue has: the decode pool's slots as last measured
    (`capacity_slots`), the slots its admitted requests use, its series. `acquire` admits a
    request (a `Ticket`), waiting for room; `set_capacity` is the load monitor's measurement.
    This gateway's queue (`AdmissionQueue`) or its part of the deployment's
    (`frontend.shared_admission.SharedAdmissionQueue`, with several gateway processes)."""

    def __init__(
        self,
        max_queued_requests: int,
        metrics: QueueMetrics,
        decode_listed: Callable[[], bool] | None = None,
        measuring_wait_s: float = MEASURING_WAIT_S,
    ) -> None:
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.decode_listed = decode_listed or (lambda: False)
        self.measuring_wait_s = measuring_wait_s
        self.capacity_slots: int | None = None
        self.num_slots_in_use = 0
        self._setup()

    @abstractmethod
    def _setup(self) -> None:
        """Set up what the subclass owns besides (called by the constructor)."""

    @abstractmethod
    async def acquire(self, num_slots: int, timeout_s: float) -> Ticket: ...

    @abstractmethod
    def set_capacity(self, capacity_slots: int | None) -> None: ...

    @property
    @abstractmethod
    def num_queued(self) -> int:
        """Requests of this gateway waiting for room."""

    @property
    def measuring(self) -> bool:
        """Decode workers are listed but none has answered Stats yet: requests wait for it."""
        return self.capacity_slots is None and self.decode_listed()

    def _refuse_if_never_fits(self, num_slots: int) -> None:
        capacity = self.capacity_slots
        if capacity is not None and num_slots > capacity:
            self._count_refusal("never_fits")
            raise never_fits(num_slots, capacity)

    def _take(self, num_slots: int) -> None:
        self.num_slots_in_use += num_slots
        self.metrics.in_use.labels(self.metrics.model_name).set(self.num_slots_in_use)

    def _untake(self, num_slots: int) -> None:
        self.num_slots_in_use -= num_slots
        self.metrics.in_use.labels(self.metrics.model_name).set(self.num_slots_in_use)

    def _observe_queued(self, queued_s: float) -> None:
        self.metrics.queued_s.labels(self.metrics.model_name).observe(queued_s)

    def _set_capacity_gauge(self) -> None:
        self.metrics.capacity.labels(self.metrics.model_name).set(self.capacity_slots or 0)

    def _set_depth(self) -> None:
        self.metrics.depth.labels(self.metrics.model_name).set(self.num_queued)

    def _count_refusal(self, reason: str) -> None:
        self.metrics.refusals.labels(self.metrics.model_name, reason).inc()


class AdmissionQueue(SlotAdmission):
    """Owns the slot ledger and the FIFO of requests waiting for room.

    Promises: admission is FIFO (a request never overtakes one that queued before it); a request
    is refused only past `max_queued_requests` waiting (429) or when it can never fit (400);
    a waiter that is cancelled (its client left) leaves the queue and holds nothing.
    """

    def _setup(self) -> None:
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    def set_capacity(self, capacity_slots: int | None) -> None:
        """The decode pool's slots as last measured (None or 0: unknown; admit everything unless
        `measuring`)."""
        self.capacity_slots = capacity_slots or None
        self._set_capacity_gauge()
        self._admit_waiters()

    async def acquire(self, num_slots: int, timeout_s: float) -> Ticket:
        """Admit a request needing `num_slots`, waiting up to `timeout_s` in FIFO order for room.

        Raises GatewayError 400 (can never fit), 429 (the queue is full) or 503 (waited too long).
        """
        self._refuse_if_never_fits(num_slots)
        if not self._waiters and self._fits(num_slots):
            return self._admit(num_slots, 0.0)
        if len(self._waiters) >= self.max_queued_requests:
            self._count_refusal("queue_full")
            raise queue_full(len(self._waiters), self.max_queued_requests)
        waiter = _Waiter(num_slots, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._set_depth()
        start_s = time.monotonic()
        try:
            await self._wait_admitted(waiter, timeout_s)
        except BaseException as exc:
            self._leave(waiter)
            if isinstance(exc, asyncio.TimeoutError):
                self._count_refusal("queue_timeout")
                raise queue_timeout(timeout_s) from None
            raise
        # Admitted: the ledger already counts the slots (see _admit_waiters).
        ticket = Ticket(self._give_back, num_slots, time.monotonic() - start_s)
        self._observe_queued(ticket.queued_s)
        return ticket

    async def _wait_admitted(self, waiter: _Waiter, timeout_s: float) -> None:
        """Until `waiter` is admitted (TimeoutError after `timeout_s`). One queued while the pool
        is still being measured goes ahead blind after `measuring_wait_s` if no Stats came."""
        if self.measuring:
            wait_s = min(self.measuring_wait_s, timeout_s)
            try:
                await asyncio.wait_for(asyncio.shield(waiter.admitted), wait_s)
                return
            except asyncio.TimeoutError:
                if self.capacity_slots is None and waiter in self._waiters:
                    self._waiters.remove(waiter)
                    self._set_depth()
                    self._take(waiter.num_slots)
                    waiter.admitted.set_result(None)
                    return
                timeout_s -= wait_s
        await asyncio.wait_for(asyncio.shield(waiter.admitted), timeout_s)

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter gives up (timeout, client gone): out of the queue, or its granted slots back."""
        granted = waiter.admitted
        if granted.done():
            if not granted.cancelled() and granted.exception() is None:
                self._give_back(waiter.num_slots)  # admitted in the same instant it gave up
            return
        waiter.admitted.cancel()
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            self._set_depth()
            self._admit_waiters()  # a large head leaving may let the next ones in

    def _fits(self, num_slots: int) -> bool:
        if self.capacity_slots is None:
            return not self.measuring
        return self.num_slots_in_use + num_slots <= self.capacity_slots

    def _admit(self, num_slots: int, queued_s: float) -> Ticket:
        self._take(num_slots)
        self._observe_queued(queued_s)
        return Ticket(self._give_back, num_slots, queued_s)

    def _give_back(self, num_slots: int) -> None:
        self._untake(num_slots)
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        """Admit from the head while it fits; a head that can no longer ever fit gets its 400."""
        while self._waiters:
            head = self._waiters[0]
            if self.capacity_slots is not None and head.num_slots > self.capacity_slots:
                self._waiters.popleft()
                try:
                    self._refuse_if_never_fits(head.num_slots)
                except GatewayError as error:
                    head.admitted.set_exception(error)
                continue
            if not self._fits(head.num_slots):
                break
            self._waiters.popleft()
            self._take(head.num_slots)
            head.admitted.set_result(None)
        self._set_depth()
