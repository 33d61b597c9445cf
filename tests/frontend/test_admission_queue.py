"""The admission queue on its own: FIFO by decode room, bounded, refusals that hold nothing."""

from __future__ import annotations

import asyncio

import pytest

from frontend.admission_queue import AdmissionQueue, QueueMetrics
from frontend.errors import GatewayError
from frontend.metrics import GatewayMetrics


def _queue(max_queued: int = 2, capacity: int | None = 4) -> AdmissionQueue:
    queue = AdmissionQueue(max_queued, QueueMetrics(GatewayMetrics("m")))
    queue.set_capacity(capacity)
    return queue


def _sample(queue: AdmissionQueue, name: str, **labels: str) -> float:
    value = queue.metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return float(value or 0.0)


async def _settle() -> None:
    """Let every task that can run, run (the queue's hand-offs are plain future results)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_admits_at_once_while_there_is_room_and_counts_the_slots() -> None:
    async def main() -> None:
        queue = _queue()
        first, second = await queue.acquire(3, 1.0), await queue.acquire(1, 1.0)
        assert queue.num_slots_in_use == 4 and queue.num_queued == 0
        first.release()
        first.release()  # idempotent
        second.release()
        assert queue.num_slots_in_use == 0

    asyncio.run(main())


def test_waiters_are_admitted_in_fifo_order_as_slots_are_released() -> None:
    async def main() -> None:
        queue = _queue(max_queued=3)
        held = await queue.acquire(4, 1.0)
        order: list[str] = []

        async def wait(name: str, num_slots: int) -> None:
            ticket = await queue.acquire(num_slots, 10.0)
            order.append(name)
            ticket.release()

        # "big" needs the whole pool: "small", queued after it, must not overtake it.
        tasks = [asyncio.ensure_future(wait(n, k)) for n, k in (("big", 4), ("small", 1), ("last", 2))]
        await _settle()
        assert queue.num_queued == 3 and order == []
        assert _sample(queue, "splitserve_admission_queue_depth") == 3
        held.release()
        await asyncio.gather(*tasks)
        assert order == ["big", "small", "last"]
        assert queue.num_slots_in_use == 0 and queue.num_queued == 0

    asyncio.run(main())


def test_past_the_cap_a_request_gets_429_and_holds_nothing() -> None:
    async def main() -> None:
        queue = _queue(max_queued=1)
        held = await queue.acquire(4, 1.0)
        waiting = asyncio.ensure_future(queue.acquire(1, 10.0))
        await _settle()
        with pytest.raises(GatewayError) as refused:
            await queue.acquire(1, 10.0)
        assert refused.value.status_code == 429 and "max_queued_requests = 1" in refused.value.message
        assert queue.num_slots_in_use == 4 and queue.num_queued == 1
        assert _sample(queue, "splitserve_admission_refusals_total", reason="queue_full") == 1
        held.release()
        (await waiting).release()
        assert queue.num_slots_in_use == 0

    asyncio.run(main())


def test_a_request_larger_than_the_pool_gets_400_at_once_even_with_the_queue_full() -> None:
    async def main() -> None:
        queue = _queue(max_queued=0)
        with pytest.raises(GatewayError) as refused:
            await queue.acquire(5, 1.0)
        assert refused.value.status_code == 400
        assert "needs 5 decode slots" in refused.value.message and "holds 4" in refused.value.message
        assert queue.num_slots_in_use == 0
        assert _sample(queue, "splitserve_admission_refusals_total", reason="never_fits") == 1

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_moves_up() -> None:
    async def main() -> None:
        queue = _queue(max_queued=2)
        held = await queue.acquire(4, 1.0)
        gone = asyncio.ensure_future(queue.acquire(4, 10.0))
        next_one = asyncio.ensure_future(queue.acquire(2, 10.0))
        await _settle()
        gone.cancel()  # its client disconnected while it waited
        await asyncio.gather(gone, return_exceptions=True)
        assert queue.num_queued == 1
        held.release()
        ticket = await next_one
        assert queue.num_slots_in_use == 2
        ticket.release()
        assert queue.num_slots_in_use == 0

    asyncio.run(main())


def test_a_waiter_that_times_out_gets_503_and_holds_nothing() -> None:
    async def main() -> None:
        queue = _queue()
        held = await queue.acquire(4, 1.0)
        with pytest.raises(GatewayError) as refused:
            await queue.acquire(1, 0.01)
        assert refused.value.status_code == 503 and refused.value.code == "queue_timeout"
        assert queue.num_queued == 0
        held.release()
        assert queue.num_slots_in_use == 0

    asyncio.run(main())


def test_more_capacity_admits_waiters_and_less_refuses_those_that_can_never_fit() -> None:
    async def main() -> None:
        queue = _queue(max_queued=2)
        held = await queue.acquire(4, 1.0)
        grows = asyncio.ensure_future(queue.acquire(2, 10.0))
        await _settle()
        queue.set_capacity(6)  # a decode worker joined: Stats show the room
        (await grows).release()
        too_big = asyncio.ensure_future(queue.acquire(6, 10.0))
        await _settle()
        assert queue.num_queued == 1
        queue.set_capacity(4)  # it left again: the waiter can never fit now
        with pytest.raises(GatewayError) as refused:
            await too_big
        assert refused.value.status_code == 400
        held.release()
        assert queue.num_slots_in_use == 0 and queue.num_queued == 0

    asyncio.run(main())


def test_unknown_capacity_admits_everything() -> None:
    async def main() -> None:
        queue = _queue(max_queued=0, capacity=None)
        tickets = [await queue.acquire(100, 1.0) for _ in range(3)]
        assert queue.num_slots_in_use == 300
        for ticket in tickets:
            ticket.release()

    asyncio.run(main())


def test_while_listed_decode_workers_are_unmeasured_requests_queue_for_the_first_stats() -> None:
    async def main() -> None:
        queue = AdmissionQueue(8, QueueMetrics(GatewayMetrics("m")), decode_listed=lambda: True)
        waiting = [asyncio.ensure_future(queue.acquire(1, 30.0)) for _ in range(3)]
        await _settle()
        assert queue.measuring and queue.num_queued == 3 and queue.num_slots_in_use == 0
        queue.set_capacity(2)  # the first Decode.Stats: two slots
        await _settle()
        assert [w.done() for w in waiting] == [True, True, False]
        assert queue.num_slots_in_use == 2 and queue.num_queued == 1
        waiting[0].result().release()
        await _settle()
        assert waiting[2].done()
        for w in waiting[1:]:
            w.result().release()
        assert queue.num_slots_in_use == 0

    asyncio.run(main())


def test_an_unmeasured_pool_that_never_answers_admits_blind_after_the_wait() -> None:
    async def main() -> None:
        queue = AdmissionQueue(
            8, QueueMetrics(GatewayMetrics("m")), decode_listed=lambda: True, measuring_wait_s=0.01
        )
        ticket = await queue.acquire(3, 30.0)  # no Stats ever came: in it goes, as before
        assert queue.num_slots_in_use == 3 and queue.num_queued == 0
        ticket.release()
        assert queue.num_slots_in_use == 0

    asyncio.run(main())
