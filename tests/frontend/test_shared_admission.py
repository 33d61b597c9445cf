"""The shared admission of several gateway processes: the ledger and each gateway's side of it,
in one event loop (the Ray transport is tested on a real deployment, tests/e2e/test_gateways_cluster.py).

Each message between a gateway and the ledger goes through the loop (`call_soon`), as over Ray:
nothing is answered inside the call that caused it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry

from frontend.admission_ledger import AdmissionLedger, Outcome
from frontend.admission_queue import AdmissionQueue, QueueMetrics, Ticket
from frontend.errors import GatewayError
from frontend.shared_admission import LedgerUnavailable, SharedAdmissionQueue


class _Metrics:
    def __init__(self) -> None:
        self.model_name = "m"
        self.registry = CollectorRegistry()


def _metrics() -> QueueMetrics:
    return QueueMetrics(_Metrics())  # type: ignore[arg-type]


class LocalLedgerClient:
    """Gateway `gateway`'s messages to an in-process ledger, each delivered by the loop."""

    def __init__(self, ledger: AdmissionLedger, gateway: int, queue: SharedAdmissionQueue) -> None:
        self.ledger, self.gateway, self.queue = ledger, gateway, queue
        self.dead = False

    def _later(self, fn: Callable[..., object], *args: object) -> None:
        if not self.dead:
            asyncio.get_running_loop().call_soon(fn, *args)

    async def register(self, held_slots: int) -> None:
        if self.dead:
            raise LedgerUnavailable("dead")
        self.ledger.register(
            self.gateway, held_slots, lambda seq, c: self._later(self.queue.on_notice, seq, c)
        )

    async def acquire(self, waiter_id: int, num_slots: int) -> Outcome:
        if self.dead:
            raise LedgerUnavailable("dead")
        return await self.ledger.acquire(self.gateway, waiter_id, num_slots)

    def give_back(self, num_slots: int, reply_to: int = 0) -> None:
        self._later(self.ledger.give_back, self.gateway, num_slots, reply_to)

    def leave(self, waiter_id: int) -> None:
        self._later(self.ledger.leave, self.gateway, waiter_id)

    def set_capacity(self, capacity_slots: int | None) -> None:
        self._later(self.ledger.set_capacity, capacity_slots)


async def _gateways(ledger: AdmissionLedger, count: int, capacity_slots: int) -> list[SharedAdmissionQueue]:
    """`count` gateways' queues attached to `ledger`, registered, each having measured the pool."""
    queues = []
    for index in range(count):
        queue = SharedAdmissionQueue(ledger.max_queued_requests, _metrics())
        queue.attach(LocalLedgerClient(ledger, index, queue))
        queue.start()
        queue.set_capacity(capacity_slots)
        queues.append(queue)
    await _until(
        lambda: all(q._registered.is_set() for q in queues) and ledger.capacity_slots == capacity_slots
    )
    return queues


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


async def _burst(
    acquires: list[Awaitable[Ticket]],
) -> tuple[list[Ticket], list[int], list[asyncio.Task[Ticket]]]:
    """Start every acquire at once; (admitted at once, statuses of the refused, the still waiting)."""
    tasks = [asyncio.ensure_future(a) for a in acquires]
    await asyncio.sleep(0.05)  # every message of the burst delivered; no timer is pending
    done = [t for t in tasks if t.done()]
    admitted = [t.result() for t in done if t.exception() is None]
    refused = [t.exception().status_code for t in done if isinstance(t.exception(), GatewayError)]  # type: ignore[union-attr]
    return admitted, refused, [t for t in tasks if not t.done()]


def test_a_burst_over_two_gateways_is_admitted_queued_and_refused_as_by_one() -> None:
    capacity, max_queued, burst = 4, 6, 20

    async def one_gateway() -> tuple[int, list[int], int]:
        queue = AdmissionQueue(max_queued, _metrics())
        queue.set_capacity(capacity)
        admitted, refused, waiting = await _burst([queue.acquire(1, 30) for _ in range(burst)])
        for task in waiting:
            task.cancel()
        return len(admitted), refused, len(waiting)

    async def two_gateways() -> tuple[int, list[int], int]:
        ledger = AdmissionLedger(max_queued)
        queues = await _gateways(ledger, 2, capacity)
        admitted, refused, waiting = await _burst([queues[i % 2].acquire(1, 30) for i in range(burst)])
        assert ledger.num_waiting == len(waiting) and ledger.num_lent == capacity
        # Waiters go in as slots free, whichever gateway frees them, in the order they came.
        for ticket in admitted:
            ticket.release()
        await _until(lambda: sum(t.done() for t in waiting) == capacity)
        assert [t.done() for t in waiting] == [True] * capacity + [False] * (len(waiting) - capacity)
        for task in waiting:
            task.cancel()
        await _until(lambda: ledger.num_waiting == 0)
        return len(admitted), refused, len(waiting)

    alone = asyncio.run(one_gateway())
    shared = asyncio.run(two_gateways())
    assert alone == shared == (capacity, [429] * (burst - capacity - max_queued), max_queued)


def test_idle_slots_one_gateway_holds_go_to_the_others_waiter() -> None:
    async def run() -> None:
        ledger = AdmissionLedger(max_queued_requests=8)
        first, second = await _gateways(ledger, 2, 4)
        tickets = [await first.acquire(1, 30) for _ in range(4)]
        for ticket in tickets:
            ticket.release()
        assert first.held_slots == 4 and first.num_slots_in_use == 0  # idle, kept for its next requests
        again = await first.acquire(1, 30)  # on an idle slot: no message
        assert ledger.num_lent == 4
        other = await asyncio.wait_for(second.acquire(2, 30), 5)  # the ledger has none: it reclaims
        assert other.num_slots == 2 and first.held_slots == 1 and second.held_slots == 2
        again.release()
        other.release()

    asyncio.run(run())


def test_a_full_queue_refuses_only_after_idle_slots_elsewhere_came_back() -> None:
    async def run() -> None:
        ledger = AdmissionLedger(max_queued_requests=0)  # no waiting at all: admit or refuse
        first, second = await _gateways(ledger, 2, 2)
        for ticket in [await first.acquire(1, 30) for _ in range(2)]:
            ticket.release()
        assert first.held_slots == 2  # the whole pool, idle at the first gateway
        ticket = await second.acquire(2, 30)
        assert ticket.num_slots == 2
        with pytest.raises(GatewayError) as refused:
            await second.acquire(1, 30)
        assert refused.value.status_code == 429 and "max_queued_requests = 0" in refused.value.message

    asyncio.run(run())


def test_a_waiter_that_times_out_leaves_the_ledgers_queue() -> None:
    async def run() -> None:
        ledger = AdmissionLedger(max_queued_requests=4)
        first, second = await _gateways(ledger, 2, 1)
        held = await first.acquire(1, 30)
        with pytest.raises(GatewayError) as timed_out:
            await second.acquire(1, 0.05)
        assert timed_out.value.status_code == 503 and timed_out.value.code == "queue_timeout"
        await _until(lambda: ledger.num_waiting == 0 and not first.contended)
        assert second.held_slots == 0 and second.num_slots_in_use == 0
        held.release()  # nobody waits any more: the slot stays with the first gateway, idle
        assert first.held_slots == 1 and ledger.held == {0: 1, 1: 0}

    asyncio.run(run())


def test_a_request_needing_more_than_the_pool_is_refused_with_400() -> None:
    async def run() -> None:
        ledger = AdmissionLedger(max_queued_requests=4)
        (queue,) = await _gateways(ledger, 1, 3)
        with pytest.raises(GatewayError) as refused:
            await queue.acquire(4, 30)
        assert refused.value.status_code == 400 and refused.value.code == "request_too_large"

    asyncio.run(run())


def test_a_restarted_gateway_registering_frees_what_its_predecessor_held() -> None:
    async def run() -> None:
        ledger = AdmissionLedger(max_queued_requests=4)
        first, second = await _gateways(ledger, 2, 2)
        await first.acquire(2, 30)  # never released: its process is about to die
        waiting = asyncio.ensure_future(second.acquire(1, 30))
        await _until(lambda: ledger.num_waiting == 1)
        (successor,) = await _gateways(ledger, 1, 2)  # index 0 again: the first gateway's restart
        assert successor.held_slots == 0
        assert (await asyncio.wait_for(waiting, 5)).num_slots == 1

    asyncio.run(run())


def test_a_restarted_ledger_lends_nothing_until_the_gateways_said_what_they_hold() -> None:
    async def run() -> None:
        old = AdmissionLedger(max_queued_requests=4)
        first, second = await _gateways(old, 2, 2)
        running = await first.acquire(2, 30)
        for queue in (first, second):
            queue._client.dead = True  # type: ignore[union-attr]
        asked = asyncio.ensure_future(second.acquire(1, 30))
        await asyncio.sleep(0.01)
        assert not asked.done()  # waits for the next ledger
        new = AdmissionLedger(max_queued_requests=4, recovering_from=[0, 1])
        new.set_capacity(2)
        second.attach(LocalLedgerClient(new, 1, second))  # the second gateway hears of it first
        await _until(lambda: new.held == {1: 0} and new.num_waiting == 1)
        first.attach(LocalLedgerClient(new, 0, first))  # the first says it holds 2: nothing to lend
        await _until(lambda: new.held == {0: 2, 1: 0})
        assert not asked.done()
        running.release()
        assert (await asyncio.wait_for(asked, 5)).num_slots == 1
        assert new.held == {0: 0, 1: 1}

    asyncio.run(run())
