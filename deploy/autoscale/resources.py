"""What the planner asks of Ray's autoscaler when a pool wants a replica the cluster cannot hold.

`ray.autoscaler.sdk.request_resources` sets the cluster's floor: the autoscaler (where a Ray
cluster runs one: `ray up`, KubeRay) adds nodes until these bundles fit, counting what runs.
Each call replaces the last one, so the planner asks for everything the deployment wants (its
pools with the extra replica, its gateway and stores), and asks again for what remains after a
scale-down. On a fixed cluster nobody reads the request; the pool stays at what fits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from deploy.members import Roster
from splitserve.config import ClusterConfig

logger = logging.getLogger("splitserve.deploy")


Bundle = tuple[dict[str, float], dict[str, str]]  # resources, and the node labels it needs


def wanted_bundles(config: ClusterConfig, roster: Roster, more: Mapping[str, int]) -> list[Bundle]:
    """Every bundle the deployment wants, each with the node labels its pool needs: each pool's
    replicas (plus `more[pool]`), each gateway process's and each store's CPUs (at least one of
    each)."""
    bundles: list[Bundle] = []
    for name, pool in roster.pools.items():
        bundles += [(dict(pool.spec.bundle), dict(pool.spec.labels))] * (pool.replicas + more.get(name, 0))
    bundles += [({"CPU": float(config.gateway.num_cpus)}, {})] * max(1, len(roster.gateways))
    num_stores = len(roster.stores)
    bundles += [({"CPU": float(config.store.num_cpus)}, {})] * max(1, num_stores)
    kept = [({k: v for k, v in b.items() if v > 0}, labels) for b, labels in bundles]
    return [(b, labels) for b, labels in kept if b]


def ask_ray_for(bundles: list[Bundle]) -> None:
    """Tell Ray's autoscaler the deployment wants `bundles` in all (replacing the last request)."""
    from ray.autoscaler.sdk import request_resources

    shapes, selectors = [b for b, _ in bundles], [labels for _, labels in bundles]
    request_resources(bundles=shapes, bundle_label_selectors=selectors if any(selectors) else None)
    logger.info("autoscale: asked Ray's autoscaler for %d bundle(s) in all: %s", len(bundles), bundles)
