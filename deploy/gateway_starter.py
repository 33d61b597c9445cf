"""Starting the gateway processes, and with several of them the admission ledger they share.

`gateway.replicas` processes run on the head node (`gateway.placement: head`) or on every node
alive at start (`every_node`); processes on one node share its port (SO_REUSEPORT; the first binds
`gateway.port`, port 0 picking a free one, and the others on that node join whatever it bound).
With more than one process the deployment's admission goes through one ledger actor on the head
node (frontend/admission_ledger.py), started first and handed to each gateway before it serves; a
ledger started again (it died) is handed to every gateway running, which tell it what they hold.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deploy.actors import gateway_settings_kwargs
from deploy.calls import call, cause
from deploy.members import Member, Roster
from deploy.placement import HEAD_NODE_RESOURCE, live_node_ids

if TYPE_CHECKING:
    from deploy.starter import ActorStarter

logger = logging.getLogger("splitserve.deploy")

# Calls that wait in the ledger's queue are pending calls on its actor: room for them all.
LEDGER_SPARE_CALLS = 1_000


class GatewayStarter:
    """Plans, starts and restarts the deployment's gateway processes and the admission ledger.

    Owns which node each gateway runs on (with `every_node`, `Member.node_id` from the plan; on
    the head, wherever that is) and the port each node's gateways share, learned from the first to
    bind it. Uses its `ActorStarter` to create
    and start actors (token, node and pid, `start()`), so every actor starts the same way.
    """

    def __init__(self, starter: ActorStarter, roster: Roster) -> None:
        self._starter = starter
        self._roster = roster
        self._ports: dict[str | None, int] = {}  # node id (None: the head) -> the port its gateways share

    def plan(self) -> None:
        """Put the gateways the config asks for (and the ledger, if more than one) in the roster."""
        cfg = self._starter.config.gateway
        nodes: list[str | None] = [None]  # the head
        if cfg.placement == "every_node":
            nodes = list(sorted(live_node_ids()))
        places = [node for node in nodes for _ in range(cfg.replicas)]
        self._roster.gateways = [Member(kind="gateway", index=i, node_id=n) for i, n in enumerate(places)]
        self._roster.ledger = Member(kind="ledger", index=0) if len(places) > 1 else None

    async def start_all(self) -> None:
        """The ledger (if any), then each gateway in turn (the first on a node binds its port)."""
        if self._roster.ledger is not None:
            await self.start_ledger(self._roster.ledger)
        for gateway in self._roster.gateways:
            await self.start_gateway(gateway)

    async def start_ledger(self, ledger: Member) -> None:
        """Start the ledger; the gateways already running are handed it and register their slots."""
        running = [g for g in self._roster.gateways if g.handle is not None]
        cls = self._starter.actor_class("ledger")
        max_queued = self._starter.config.gateway.max_queued_requests
        ledger.handle = cls.options(
            num_cpus=0,
            max_restarts=0,
            max_concurrency=max_queued + LEDGER_SPARE_CALLS,
            resources={HEAD_NODE_RESOURCE: 0.001},
        ).remote(max_queued, [g.index for g in running])
        ledger.address = await self._starter.started_at(ledger, "", 0)
        for gateway in running:
            try:
                await call(gateway.handle.use_ledger.remote(ledger.handle, gateway.index), self._timeout_s)
            except Exception as exc:  # its health probe finds out what ails it; a restart hands it over
                logger.warning("gateway %d could not take the new ledger: %s", gateway.index, cause(exc))

    async def start_gateway(self, gateway: Member) -> None:
        """Start one gateway process where the plan put it, told the ledger before it serves."""
        config, cfg = self._starter.config, self._starter.config.gateway
        kwargs = gateway_settings_kwargs(config, self._starter.model_path)
        if len(self._roster.gateways) > 1:  # named only then, so a settings class without it still fits
            kwargs["num_gateways"] = len(self._roster.gateways)
        settings = self._starter.actor_class("gateway_settings")(**kwargs)
        place = gateway.node_id if cfg.placement == "every_node" else None  # None: the head, wherever
        where: dict[str, Any] = (
            {"scheduling_strategy": NodeAffinitySchedulingStrategy(place, soft=False)}
            if place is not None
            else {"resources": {HEAD_NODE_RESOURCE: 0.001}}
        )
        cls = self._starter.actor_class("gateway")
        gateway.handle = cls.options(num_cpus=cfg.num_cpus, max_restarts=0, **where).remote(settings)
        ledger = self._roster.ledger
        if ledger is not None and ledger.handle is not None:  # admits through it from its first request
            await call(gateway.handle.use_ledger.remote(ledger.handle, gateway.index), self._timeout_s)
        port = self._ports.get(place, cfg.port)
        gateway.address = await self._starter.started_at(gateway, cfg.host, port, on_node=place)
        self._ports[place] = int(gateway.address.rpartition(":")[2])

    def forget(self, gateway: Member) -> None:
        """A gateway process is ended: what the ledger lent it is free (its successor holds none)."""
        ledger = self._roster.ledger
        if ledger is not None and ledger.handle is not None:
            ledger.handle.forget.remote(gateway.index)

    @property
    def _timeout_s(self) -> float:
        return self._starter.config.health.timeout_s
