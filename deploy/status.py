"""The controller's `status()` report: plain JSON-ready data about every actor of the deployment.

Its shape is documented in deploy/README.md ("Status as JSON"); `splitserve status --json`
prints it as is, and deploy/report.py turns it into the status table.
"""

from __future__ import annotations

from typing import Any

from deploy.members import Member, Roster
from deploy.placement import NodeIps
from deploy.publisher import WorkerLists


def build_status(
    roster: Roster,
    *,
    mode: str,
    model: str,
    started: bool,
    stopped: bool,
    published: WorkerLists | None,
    node_ips: NodeIps,
    apply: dict[str, Any],
    autoscale: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything at a glance: per pool replicas (desired and running), addresses, health,
    restarts and load; per worker, store, gateway process and the admission ledger its place,
    process, health and what it last reported; the last apply's plan and steps (`apply`); per
    autoscaled pool its bounds, desired and actual replicas and the planner's last decision
    (`autoscale`). `gateway` is the first gateway process's row (the one URL clients need),
    `gateways` all."""
    ips = node_ips.known
    pools = {name: pool.summary(ips) for name, pool in roster.pools.items()}
    gateways = []
    for member in roster.gateways:
        row = member.row(ips)
        row["url"] = _gateway_url(member, node_ips)
        gateways.append(row)
    ledger = roster.ledger.row(ips) if roster.ledger else None
    stores = [store.row(ips) for store in roster.stores.values()]
    everything = [*gateways, *stores, *([ledger] if ledger else [])]
    healthy = (
        started
        and not stopped
        and bool(gateways)
        and all(p["healthy"] for p in pools.values())
        and all(row["healthy"] for row in everything)
    )
    return {
        "mode": mode,
        "model": model,
        "started": started,
        "stopped": stopped,
        "healthy": healthy,
        "gateway": gateways[0] if gateways else None,
        "gateways": gateways,
        "ledger": ledger,
        "pools": pools,
        "stores": stores,
        "published": {"prefill": published[0], "decode": published[1]} if published else None,
        "apply": apply,
        "autoscale": autoscale or {},
    }


def _gateway_url(gateway: Member, node_ips: NodeIps) -> str | None:
    if gateway.address is None:
        return None
    host, _, port = gateway.address.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]"):  # bound to every interface: name the node's own
        host = node_ips.ip(gateway.node_id)
    return f"http://{host}:{port}"
