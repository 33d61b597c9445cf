"""Telling every gateway process which workers to route to."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from deploy.calls import call, cause
from deploy.members import Member, Roster

logger = logging.getLogger("splitserve.deploy")

WorkerLists = tuple[list[str], list[str]]  # (prefill addresses, decode addresses)


class WorkerPublisher:
    """Sends each gateway the healthy workers' addresses, and each one's node store (so a
    prefill's state is read where it was written, and decodes on its node are preferred),
    whenever they change.

    Remembers what it last told each gateway actor (by handle), so a restarted gateway (a new
    handle) is told again even though the lists did not change; every gateway hears the same
    lists in one pass. In colocated mode the one pool's list goes to the gateways as both the
    prefill and the decode list. A failed `update_workers` is logged and retried on the next
    `publish` (the health pass finds out what ails that gateway).
    """

    def __init__(self, mode: str, roster: Roster, timeout_s: float) -> None:
        self._mode = mode
        self._roster = roster
        self.timeout_s = timeout_s
        self._told: dict[int, tuple[Any, WorkerLists, dict[str, str]]] = {}  # gateway index -> what it heard

    @property
    def published(self) -> WorkerLists | None:
        """The lists every running gateway has heard, or None while one (or all) has heard none
        or other lists than the rest."""
        heard = [self._heard(g) for g in self._roster.gateways if g.handle is not None]
        if not heard or any(lists is None or lists != heard[0] for lists in heard):
            return None
        return heard[0]

    def _heard(self, gateway: Member) -> WorkerLists | None:
        told = self._told.get(gateway.index)
        return told[1] if told is not None and told[0] is gateway.handle else None

    async def publish(self, *, force: bool = False) -> None:
        """Tell each healthy gateway the healthy worker addresses, if they changed since it last heard."""
        pools = self._roster.pools
        if self._mode == "colocated":
            both = pools["prefill"].healthy_addresses
            lists = (both, list(both))
        else:
            lists = (pools["prefill"].healthy_addresses, pools["decode"].healthy_addresses)
        stores = self._worker_stores()
        due = [
            g
            for g in self._roster.gateways
            if g.healthy
            and g.handle is not None
            and (force or self._told.get(g.index) != (g.handle, lists, stores))
        ]
        await asyncio.gather(*(self._tell(g, lists, stores) for g in due))

    async def _tell(self, gateway: Member, lists: WorkerLists, stores: dict[str, str]) -> None:
        handle = gateway.handle
        try:
            await call(handle.update_workers.remote(*lists, stores=stores), self.timeout_s)
        except Exception as exc:  # the next health pass finds out what is wrong with the gateway
            logger.warning("gateway %d: update_workers failed: %s", gateway.index, cause(exc))
            return
        self._told[gateway.index] = (handle, lists, stores)

    def _worker_stores(self) -> dict[str, str]:
        """Each healthy worker's address -> the address of the store on its node (when up)."""
        stores = {}
        for worker in self._roster.workers():
            store = self._roster.stores.get(worker.node_id or "")
            if worker.healthy and worker.address and store is not None and store.address:
                stores[worker.address] = store.address
        return stores
