"""Keeps the router's view of decode load fresh and the store gauges filled.

One background task per app: every `stats_refresh_s`, or sooner after a routing decision
(`kick()`), it reads `Decode.Stats` from every decode worker, the health check of every prefill
worker and `StateStore.Stats` from every store a reservation has named. A worker that does not
answer is marked unreachable in the router, which then neither picks nor ranks it, until it
answers again (`probe(address)` asks one worker at once, e.g. after a request's call to it
failed). A decode worker whose state slots are held by nothing it runs or has reserved is
recorded as holding idle slots (a leak the health endpoint reports). After each pass it tells
the admission queue the decode pool's capacity in slots: the listed workers' that have answered,
as they last did (a lower bound while a new worker's first Stats is pending; unknown while none
has).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from frontend.clients import WorkerClients
from frontend.errors import GatewayError
from frontend.metrics import GatewayMetrics
from frontend.router import DecodeLoad, Router

logger = logging.getLogger(__name__)


class LoadMonitor:
    """Owns the refresh task; `start()`/`stop()` run on the app's event loop."""

    def __init__(
        self,
        router: Router,
        clients: WorkerClients,
        metrics: GatewayMetrics,
        refresh_s: float,
        on_capacity: Callable[[int | None], None] | None = None,
    ) -> None:
        self.router = router
        self.clients = clients
        self.metrics = metrics
        self.refresh_s = refresh_s
        self.on_capacity = on_capacity
        self._slots: dict[str, int] = {}  # decode address -> requests it can hold at once
        # decode address -> state slots in use that neither a running request nor a reservation holds
        self.idle_held_slots: dict[str, int] = {}
        self.full: set[str] = set()  # decode workers whose last Stats showed no free state slot
        self.decode_loads: dict[
            str, DecodeLoad
        ] = {}  # decode address -> its last Stats (the autoscaler reads it)
        self.store_addresses: set[str] = set()
        self._kick: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.num_refreshes = 0

    def start(self) -> None:
        self._kick = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def kick(self) -> None:
        """Refresh soon: a decision just changed some worker's load."""
        if self._kick is not None:
            self._kick.set()

    def saw_store(self, address: str) -> None:
        if address:
            self.store_addresses.add(address)

    def on_route(self, store_address: str) -> None:
        """A reservation was placed: watch its store, and refresh the load it changed soon."""
        self.saw_store(store_address)
        self.kick()

    async def refresh(self) -> None:
        decode = self.router.decode_addresses
        self.metrics.set_workers(len(self.router.prefill_addresses), len(decode))
        prefill = [a for a in self.router.prefill_addresses if a not in decode]  # colocated: once
        await asyncio.gather(
            *map(self._refresh_decode, decode),
            *map(self._refresh_prefill, prefill),
            *map(self._refresh_store, self.store_addresses),
        )
        self._slots = {a: n for a, n in self._slots.items() if a in decode}
        self.idle_held_slots = {a: n for a, n in self.idle_held_slots.items() if a in decode}
        self.full &= set(decode)
        self.decode_loads = {a: load for a, load in self.decode_loads.items() if a in decode}
        # channels to workers and stores that left (restarts and resizes bring new addresses)
        await self.clients.retain({*self.router.prefill_addresses, *decode, *self.store_addresses})
        if self.on_capacity is not None:
            # a worker not measured yet adds nothing: the queue admits by the room it knows of
            # rather than blindly, which would meet the workers' own "full" refusals (429)
            self.on_capacity(sum(self._slots[a] for a in decode if a in self._slots) or None)
        self.num_refreshes += 1

    async def _run(self) -> None:
        assert self._kick is not None
        while True:
            try:
                await self.refresh()
            except Exception:  # the monitor must outlive any one bad answer
                logger.exception("load refresh failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), timeout=self.refresh_s)
            self._kick.clear()

    async def probe(self, address: str) -> bool:
        """Ask one worker now whether it answers (its Stats, or its health check if it is a
        prefill worker), updating the router; whether it did."""
        if address in self.router.decode_addresses:
            await self._refresh_decode(address)
        elif address in self.router.prefill_addresses:
            await self._refresh_prefill(address)
        return address not in self.router.unreachable()

    async def _refresh_prefill(self, address: str) -> None:
        try:
            serving = await self.clients.serving(address)
        except GatewayError as exc:
            self.router.mark_unreachable(address, exc.message)
            return
        if serving:
            self.router.mark_reachable(address)
        else:  # shutting down (a drain): it takes no new prompt
            self.router.mark_unreachable(address, f"prefill worker {address} is not serving")

    async def _refresh_decode(self, address: str) -> None:
        try:
            stats = await self.clients.decode_stats(address)
        except GatewayError as exc:
            logger.debug("Decode.Stats on %s failed: %s", address, exc.message)
            self.router.observe_decode_load(address, None)
            self.router.mark_unreachable(address, exc.message)
            return  # its last known capacity stays: a listed worker is expected back
        self.router.mark_reachable(address)
        in_use = stats.num_total_state_slots - stats.num_free_state_slots
        self.idle_held_slots[address] = max(0, in_use - stats.num_running_seqs - stats.num_reserved)
        if stats.num_free_state_slots <= 0:
            self.full.add(address)
        else:
            self.full.discard(address)
        total_slots = stats.num_total_state_slots
        self._slots[address] = min(total_slots, stats.max_num_seqs) if stats.max_num_seqs else total_slots
        load = DecodeLoad(
            num_free_kv_blocks=stats.num_free_kv_blocks,
            num_total_kv_blocks=stats.num_total_kv_blocks,
            num_free_state_slots=stats.num_free_state_slots,
            num_total_state_slots=stats.num_total_state_slots,
        )
        self.decode_loads[address] = load
        self.router.observe_decode_load(address, load)

    async def _refresh_store(self, address: str) -> None:
        try:
            stats = await self.clients.store_stats(address)
        except GatewayError as exc:
            logger.debug("StateStore.Stats on %s failed: %s", address, exc.message)
            self.store_addresses.discard(address)  # watched again once a reservation names it
            return
        for tier in stats.tiers:
            self.metrics.set_store_usage(address, tier.name, tier.num_bytes, tier.capacity_bytes)
        self.metrics.set_store_prefix(address, stats)
