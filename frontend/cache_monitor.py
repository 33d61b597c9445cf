"""Feeds the router the prefill workers' prefix events, and the metrics their cache counters.

Why a poll: the engine publishes an event when a prefix unit becomes a usable hit and when it
stops being one (`LLMEngine.take_prefix_events`); each worker numbers them, and this monitor
reads every worker's events after its own cursor every `refresh_s` (`Prefill.CacheReport`),
off every request's path. Each gateway process keeps its own cursors, so with several gateways
each sees every event: their indexes agree on what the workers reported within `refresh_s`.
The first report from a worker (or after it restarted, or when this gateway fell further behind
than the worker's log reaches) is a snapshot of every unit usable there, which replaces what the
router believed. Between polls the router still has this gateway's own record of where it sent
which chain, so a burst of requests sharing a new prefix sticks together at once.
"""

from __future__ import annotations

import asyncio
import logging

from frontend.clients import WorkerClients
from frontend.errors import GatewayError
from frontend.prefix_index import CacheEvent
from frontend.prefix_metrics import PrefixMetrics
from frontend.router import Router

logger = logging.getLogger(__name__)


class CacheMonitor:
    """Owns the polling task; `start()`/`stop()` run on the app's event loop. A worker that does
    not answer (or predates the RPC) keeps what the router believes of it until it does."""

    def __init__(
        self, router: Router, clients: WorkerClients, metrics: PrefixMetrics, refresh_s: float
    ) -> None:
        self.router = router
        self.clients = clients
        self.metrics = metrics
        self.refresh_s = refresh_s
        self.num_reports = 0
        self._reported: set[str] = set()  # workers with gauges, to drop when they leave
        self._cursors: dict[str, tuple[str, int]] = {}  # worker -> (instance id, last event applied)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def refresh(self) -> None:
        """One report from every prefill worker, applied as each answers; the gauges of workers
        that left the pool go."""
        addresses = self.router.prefill_addresses
        for gone in self._reported - set(addresses):
            self.metrics.forget_worker(gone)
            self._reported.discard(gone)
        self._cursors = {a: c for a, c in self._cursors.items() if a in addresses}
        await asyncio.gather(*map(self._refresh_one, addresses))

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # the poll must outlive any one bad answer
                logger.exception("prefix cache report failed")
            await asyncio.sleep(self.refresh_s)

    async def _refresh_one(self, address: str) -> None:
        try:
            report = await self.clients.cache_report(address, *self._cursors.get(address, ("", 0)))
        except GatewayError as exc:
            logger.debug("Prefill.CacheReport on %s failed: %s", address, exc.message)
            return
        events = [CacheEvent(e.stored, e.block_hash, e.num_tokens) for e in report.events]
        self.router.observe_cache_events(address, report.instance_id, events, snapshot=report.snapshot)
        self._cursors[address] = (report.instance_id, report.last_seq)
        self.metrics.observe_report(address, report)
        self._reported.add(address)
        self.num_reports += 1
