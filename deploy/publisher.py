"""Telling the gateway which workers to route to."""

from __future__ import annotations

import logging
from typing import Any

from deploy.calls import call, cause
from deploy.members import Roster

logger = logging.getLogger("splitserve.deploy")

WorkerLists = tuple[list[str], list[str]]  # (prefill addresses, decode addresses)


class WorkerPublisher:
    """Sends the gateway the healthy workers' addresses, and each one's node store (so a
    prefill's state is read where it was written, and decodes on its node are preferred),
    whenever they change.

    Remembers what it last told which gateway actor, so a restarted gateway (a new handle) is
    told again even though the lists did not change. In colocated mode the one pool's list goes
    to the gateway as both the prefill and the decode list. A failed `update_workers` is logged
    and retried on the next `publish` (the health pass finds out what ails the gateway).
    """

    def __init__(self, mode: str, roster: Roster, timeout_s: float) -> None:
        self._mode = mode
        self._roster = roster
        self.timeout_s = timeout_s
        self._told: Any = None  # the gateway handle that heard `_lists`
        self._lists: WorkerLists | None = None
        self._stores: dict[str, str] = {}  # worker address -> its node's store, as last told

    @property
    def published(self) -> WorkerLists | None:
        """The lists the running gateway has heard, or None while it has heard none."""
        gateway = self._roster.gateway
        if gateway is None or gateway.handle is None or gateway.handle is not self._told:
            return None
        return self._lists

    async def publish(self, *, force: bool = False) -> None:
        """Tell the gateway the healthy worker addresses, if they changed since it last heard."""
        gateway = self._roster.gateway
        if gateway is None or not gateway.healthy or gateway.handle is None:
            return
        pools = self._roster.pools
        if self._mode == "colocated":
            both = pools["prefill"].healthy_addresses
            lists = (both, list(both))
        else:
            lists = (pools["prefill"].healthy_addresses, pools["decode"].healthy_addresses)
        stores = self._worker_stores()
        if not force and lists == self.published and stores == self._stores:
            return
        try:
            await call(gateway.handle.update_workers.remote(*lists, stores=stores), self.timeout_s)
        except Exception as exc:  # the next health pass finds out what is wrong with the gateway
            logger.warning("update_workers failed: %s", cause(exc))
            return
        self._told, self._lists, self._stores = gateway.handle, lists, stores

    def _worker_stores(self) -> dict[str, str]:
        """Each healthy worker's address -> the address of the store on its node (when up)."""
        stores = {}
        for worker in self._roster.workers():
            store = self._roster.stores.get(worker.node_id or "")
            if worker.healthy and worker.address and store is not None and store.address:
                stores[worker.address] = store.address
        return stores
