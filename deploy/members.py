"""What the controller knows about each actor it owns, and the pools they form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.config import PoolConfig


@dataclass
class Member:
    """One actor the controller owns: a state store, a worker or the gateway.

    `handle` is None while the actor is down (between a death and its restart, or for good once
    `given_up`). `group`/`bundle_index` are the placement-group bundle a worker lives in, so a
    restart lands on the same reservation.
    """

    kind: str  # "store", "gateway", "prefill", "decode" or "colocated"
    index: int
    pool: str | None = None
    node_id: str | None = None
    group: Any = None  # ray.util.placement_group.PlacementGroup
    bundle_index: int = 0
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
    """One worker pool: its config section, its members in index order, its placement groups.

    Ray placement groups cannot grow, so each resize up adds one group for the new replicas
    (the pool's strategy holds within each group); a group is removed once no member uses it.
    """

    name: str
    role: str
    section: PoolConfig
    members: list[Member] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)
    next_index: int = 0

    @property
    def healthy_addresses(self) -> list[str]:
        return [m.address for m in self.members if m.healthy and m.address]

    def summary(self, node_ips: dict[str, str]) -> dict[str, Any]:
        rows = [m.row(node_ips) for m in self.members]
        return {
            "role": self.role,
            "replicas": len(self.members),
            "placement": self.section.placement,
            "bundle": bundle_of(self.section),
            "addresses": self.healthy_addresses,
            "num_healthy": sum(m.healthy for m in self.members),
            "healthy": bool(self.members) and all(m.healthy for m in self.members),
            "restarts": sum(m.restarts for m in self.members),
            "load": sum_numeric([m.stats for m in self.members]),
            "workers": rows,
        }


@dataclass
class Roster:
    """Every actor one deployment owns right now: the pools' workers, a store per node, the gateway.

    Plain records; the controller and its helpers (starter, health watcher, publisher) change
    them only under the controller's lock.
    """

    pools: dict[str, Pool] = field(default_factory=dict)
    stores: dict[str, Member] = field(default_factory=dict)  # node id -> that node's store
    gateway: Member | None = None

    def workers(self) -> list[Member]:
        return [m for pool in self.pools.values() for m in pool.members]

    def members(self) -> list[Member]:
        """Everything, in the order a health pass restarts it: stores, workers, gateway."""
        return [*self.stores.values(), *self.workers(), *([self.gateway] if self.gateway else [])]

    def workers_on(self, node_id: str | None) -> list[Member]:
        return [m for m in self.workers() if m.node_id == node_id]


def bundle_of(section: PoolConfig) -> dict[str, float]:
    """The Ray resources one replica of the pool reserves: its CPUs, GPUs and custom resources."""
    bundle = {"CPU": float(section.num_cpus)}
    if section.num_gpus > 0:
        bundle["GPU"] = float(section.num_gpus)
    bundle.update({name: float(amount) for name, amount in section.resources.items()})
    return bundle


def sum_numeric(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Add up the numeric entries of several stats dicts (the pool's load at a glance)."""
    total: dict[str, float] = {}
    for entry in stats:
        for key, value in entry.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total
