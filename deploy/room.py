"""Whether a pool's bundles can ever fit the Ray cluster, answered before waiting for them.

A placement group that does not fit waits for resources until `health.start_timeout_s` runs
out. When the cluster as it stands can never hold the bundles, `check_room` says so at once:
no node has room for one bundle, too few nodes for STRICT_SPREAD, no node for all of a
STRICT_PACK, or more of a resource than the cluster has beyond what the rest of this
deployment takes. Resources that others hold are not counted against a request (they may be
freed), so a request short only of those still waits; nodes an autoscaler might add are not
foreseen. A pool with `node_labels` counts only the nodes that carry them (no such node is an
error at once), and is not checked against the cluster's totals: what the rest of the deployment
holds may lie on other nodes, so only the wait can tell.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import ray

from deploy.members import Pool, Roster
from deploy.worker_spec import WorkerSpec
from splitserve.config import ClusterConfig

_EPSILON = 1e-9  # fractional CPUs add up inexactly


class PlacementError(RuntimeError):
    """A pool's bundles cannot be placed: the cluster lacks the resources (at all, or in time)."""


def check_room(pool: str, spec: WorkerSpec, count: int, held: Mapping[str, float]) -> None:
    """Raise `PlacementError` now if `count` more bundles of `spec` for `pool` can never be placed.

    `held`: what the rest of this deployment takes, by resource name ("CPU", "GPU"). A
    tensor-parallel replica takes one bundle per rank, all on one node.
    """
    bundle, labels = spec.bundle, spec.labels
    shortfall = _shortfall(bundle, count * spec.num_ranks, spec.placement, held, labels)
    if not shortfall and count and spec.num_ranks > 1:
        shortfall = _ranks_shortfall(bundle, spec.num_ranks, labels)
    if shortfall:
        ranks = f" ({spec.num_ranks} ranks each)" if spec.num_ranks > 1 else ""
        raise PlacementError(
            f"pool {pool!r}: cannot reserve {count}{ranks} x {bundle}{on_labels(labels)} "
            f"({spec.placement}): {shortfall}. Lower {pool}.replicas, num_cpus, num_gpus or "
            "resources, or add nodes."
        )


def check_start_room(config: ClusterConfig, pools: Iterable[Pool]) -> None:
    """`check_room` for every pool of a deployment about to start, each after those before it.

    The head node's gateway processes and one store count as taken from the start (every
    deployment has them).
    """
    held = {"CPU": config.gateway.num_cpus * config.gateway.replicas + config.store.num_cpus}
    for pool in pools:
        if pool.replicas:
            check_room(pool.name, pool.spec, pool.replicas, held)
        take(held, pool.spec.bundle, pool.replicas * pool.spec.num_ranks)


def take(held: dict[str, float], bundle: Mapping[str, float], count: int) -> None:
    """Count `count` more `bundle`s in `held` (what the deployment takes, by resource)."""
    for name, amount in bundle.items():
        held[name] = held.get(name, 0.0) + amount * count


def held_resources(config: ClusterConfig, roster: Roster) -> dict[str, float]:
    """What the deployment holds now: every bundle of its placement groups (a group keeps the
    bundles of replicas that a resize removed until all of its replicas are gone), and the
    CPUs of its running stores and gateway processes."""
    held: dict[str, float] = {}
    for pool in roster.pools.values():
        for group in pool.groups:
            for bundle in group.bundle_specs:
                take(held, bundle, 1)
    num_stores = sum(store.handle is not None for store in roster.stores.values())
    cpus = num_stores * config.store.num_cpus
    cpus += sum(gateway.handle is not None for gateway in roster.gateways) * config.gateway.num_cpus
    held["CPU"] = held.get("CPU", 0.0) + cpus
    return held


def on_labels(labels: Mapping[str, str]) -> str:
    """The words naming a pool's `node_labels` in a message (nothing when it has none)."""
    return f" on nodes labelled {dict(labels)}" if labels else ""


def labels_match(node_labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Whether a node with `node_labels` satisfies a Ray label selector: per key a value, "!value",
    "in(a,b)" or "!in(a,b)"."""
    for key, want in selector.items():
        negate = want.startswith("!")
        want = want.removeprefix("!")
        if want.startswith("in(") and want.endswith(")"):
            values = {value.strip() for value in want[3:-1].split(",")}
        else:
            values = {want}
        if (node_labels.get(key) in values) == negate:
            return False
    return True


def _shortfall(
    bundle: dict[str, float],
    count: int,
    strategy: str,
    held: Mapping[str, float],
    labels: Mapping[str, str],
) -> str | None:
    """Why `count` bundles can never fit, or None if they might."""
    alive = [node for node in ray.nodes() if node["Alive"]]
    nodes = [node["Resources"] for node in alive if labels_match(node.get("Labels") or {}, labels)]
    if not nodes:
        return f"no node carries the labels {dict(labels)} (give a node them with `ray start --labels`)"
    fits = [_num_fitting(node, bundle) for node in nodes]
    if max(fits, default=0) == 0:
        most = {name: max((node.get(name, 0.0) for node in nodes), default=0.0) for name in bundle}
        return f"no node has room for one (the largest have {_amounts(most)})"
    num_roomy_nodes = sum(f > 0 for f in fits)
    if strategy == "STRICT_SPREAD" and num_roomy_nodes < count:
        return f"STRICT_SPREAD needs {count} nodes with room for one each; the cluster has {num_roomy_nodes}"
    if strategy == "STRICT_PACK" and max(fits) < count:
        return f"STRICT_PACK needs one node with room for all {count}; the roomiest holds {max(fits)}"
    if labels:  # what the rest of the deployment holds may lie on other nodes: only the wait can tell
        return None
    total = ray.cluster_resources()
    for name, amount in bundle.items():
        need, have, taken = count * amount, total.get(name, 0.0), held.get(name, 0.0)
        if need > have - taken + _EPSILON:
            free = ray.available_resources().get(name, 0.0)
            return (
                f"they need {name} {need:g}, and the Ray cluster has {name} {have:g} in all, "
                f"of which the rest of this deployment takes {taken:g} (free now: {free:g})"
            )
    return None


def _ranks_shortfall(bundle: dict[str, float], num_ranks: int, labels: Mapping[str, str]) -> str | None:
    """Why no node can ever hold one replica's `num_ranks` bundles (its ranks share a node), or None."""
    nodes = [
        node["Resources"]
        for node in ray.nodes()
        if node["Alive"] and labels_match(node.get("Labels") or {}, labels)
    ]
    roomiest = max((_num_fitting(node, bundle) for node in nodes), default=0)
    if roomiest >= num_ranks:
        return None
    return f"a replica's {num_ranks} ranks run on one node; the roomiest holds {roomiest} of their bundles"


def cluster_has(names: Iterable[str]) -> str:
    """E.g. "CPU 2 in all, 0.5 free; GPU 8 in all, 0 free" for the named resources."""
    total, free = ray.cluster_resources(), ray.available_resources()
    return "; ".join(f"{n} {total.get(n, 0.0):g} in all, {free.get(n, 0.0):g} free" for n in names)


def _num_fitting(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many bundles the node's total resources hold."""
    return min(math.floor(node.get(name, 0.0) / amount + _EPSILON) for name, amount in bundle.items())


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {amount:g}" for name, amount in resources.items())
