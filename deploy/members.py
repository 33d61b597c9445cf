"""What the controller knows about each actor it owns, and the pools they form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deploy.worker_spec import WorkerSpec


@dataclass
class Member:
    """One actor the controller owns: a state store, a worker, a gateway or the admission ledger.

    `handle` is None while the actor is down (between a death and its restart, or for good once
    `given_up`). `group`/`bundle_index` are the placement-group bundle a worker lives in, so a
    restart lands on the same reservation; `spec` is what a worker runs there (a restart runs it
    again, even when the pool's spec has changed since: its bundle was reserved for it).
    """

    kind: str  # "store", "gateway", "ledger", "prefill", "decode" or "colocated"
    index: int
    pool: str | None = None
    node_id: str | None = None
    group: Any = None  # ray.util.placement_group.PlacementGroup
    bundle_index: int = 0
    spec: WorkerSpec | None = None  # a worker's engine config and reservation; None for the others
    handle: Any = None  # ray.actor.ActorHandle
    address: str | None = None
    pid: int | None = None  # of the actor's process, once it started
    healthy: bool = False
    restarts: int = 0  # since the deployment started
    restart_times_s: list[float] = field(default_factory=list)  # time.monotonic() of the recent ones
    given_up: bool = False  # dead after max_restarts restarts within the restart window; left down
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def row(self, node_ips: dict[str, str]) -> dict[str, Any]:
        """This actor in `status()`: see "Status as JSON" in deploy/README.md for each field."""
        return {
            "kind": self.kind,
            "pool": self.pool,
            "index": self.index,
            "address": self.address,
            "node_id": self.node_id,
            "node_ip": node_ips.get(self.node_id or ""),
            "pid": self.pid,
            "healthy": self.healthy,
            "restarts": self.restarts,
            "given_up": self.given_up,
            "error": self.error,
            "stats": dict(self.stats),
        }


@dataclass
class Pool:
    """One worker pool: what it should run (`spec`, `replicas`), its members in index order, and
    its placement groups.

    Ray placement groups cannot grow, so each step that adds replicas adds one group for them
    (the pool's strategy holds within each group); a group is removed once no member uses it.
    A member whose spec differs from the pool's is outdated: an apply is replacing it, or one
    stopped before it could (the next apply goes on).
    """

    name: str
    role: str
    spec: WorkerSpec
    replicas: int  # how many the config asks for; len(members) is how many there are
    members: list[Member] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)
    # bundles whose worker was removed while others still use their group: a new worker whose
    # spec reserves the same takes one over (Ray frees a group only whole)
    vacated: list[Member] = field(default_factory=list)
    next_index: int = 0

    @property
    def healthy_addresses(self) -> list[str]:
        return [m.address for m in self.members if m.healthy and m.address]

    def outdated(self) -> list[Member]:
        """The members that run another spec than the pool's, oldest first."""
        return [m for m in self.members if m.spec != self.spec]

    def summary(self, node_ips: dict[str, str]) -> dict[str, Any]:
        rows = [{**m.row(node_ips), "outdated": m.spec != self.spec} for m in self.members]
        return {
            "role": self.role,
            "replicas": len(self.members),
            "desired_replicas": self.replicas,
            "num_outdated": len(self.outdated()),
            "placement": self.spec.placement,
            "bundle": self.spec.bundle,  # per rank
            "tensor_parallel": self.spec.num_ranks,
            "node_labels": self.spec.labels,
            "addresses": self.healthy_addresses,
            "num_healthy": sum(m.healthy for m in self.members),
            # a pool the config empties (a prefill pool under decode_local) is healthy empty
            "healthy": bool(self.members or not self.replicas) and all(m.healthy for m in self.members),
            "restarts": sum(m.restarts for m in self.members),
            "load": sum_numeric([m.stats for m in self.members]),
            "workers": rows,
        }


@dataclass
class Roster:
    """Every actor one deployment owns right now: the pools' workers, a store per node, the
    gateway processes, and the admission ledger they share when there are several.

    Plain records; the controller and its helpers (starter, health watcher, publisher) change
    them only under the controller's lock.
    """

    pools: dict[str, Pool] = field(default_factory=dict)
    stores: dict[str, Member] = field(default_factory=dict)  # node id -> that node's store
    gateways: list[Member] = field(default_factory=list)  # by index
    ledger: Member | None = None  # with several gateways: their shared admission

    def workers(self) -> list[Member]:
        return [m for pool in self.pools.values() for m in pool.members]

    def members(self) -> list[Member]:
        """Everything, in the order a health pass restarts it: stores, workers, the ledger,
        gateways (a restarted ledger is handed to the gateways running then)."""
        ledger = [self.ledger] if self.ledger else []
        return [*self.stores.values(), *self.workers(), *ledger, *self.gateways]

    def workers_on(self, node_id: str | None) -> list[Member]:
        return [m for m in self.workers() if m.node_id == node_id]


def sum_numeric(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Add up the numeric entries of several stats dicts (the pool's load at a glance)."""
    total: dict[str, float] = {}
    for entry in stats:
        for key, value in entry.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total
