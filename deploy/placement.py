"""Where the deployment's actors go: placement groups for the pools, and node id -> IP.

Each pool reserves one placement group per start or resize up (Ray groups cannot grow), one
bundle per replica; `reserve` waits for it and fails with `PlacementError` if the cluster
cannot give it in time. Before waiting, `check_room` (deploy/room.py) fails at once when the
bundles can never fit.

When a node dies, Ray re-places the bundles it held on nodes with room for them (the group is
RESCHEDULING meanwhile); `placed_node` waits for a worker's bundle to sit on a live node again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from deploy.calls import call
from deploy.members import Member, Pool, bundle_of
from deploy.room import PlacementError, cluster_has

HEAD_NODE_RESOURCE = "node:__internal_head__"  # every Ray head node has 1 of it

__all__ = [
    "HEAD_NODE_RESOURCE",
    "NodeIps",
    "PlacementError",
    "live_node_ids",
    "placed_node",
    "release_groups",
    "reserve",
]
_PLACED_POLL_S = 0.2


async def reserve(pool: Pool, count: int, wait_s: float) -> list[Member]:
    """Reserve `count` bundles for `pool` in one new placement group; add and return their members."""
    bundle = bundle_of(pool.section)
    group = placement_group([dict(bundle) for _ in range(count)], strategy=pool.section.placement)
    try:
        await call(group.ready(), wait_s)
    except asyncio.TimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"pool {pool.name!r}: could not reserve {count} x {bundle} ({pool.section.placement}) "
            f"within {wait_s:g} s; the Ray cluster has {cluster_has(bundle)}. Lower "
            f"{pool.name}.replicas, num_cpus or num_gpus, free what else holds them, or add nodes."
        ) from None
    pool.groups.append(group)
    nodes = placement_group_table(group)["bundles_to_node_id"]
    members = [
        Member(
            kind=pool.role,
            index=pool.next_index + i,
            pool=pool.name,
            node_id=nodes[i],
            group=group,
            bundle_index=i,
        )
        for i in range(count)
    ]
    pool.next_index += count
    pool.members.extend(members)
    return members


def live_node_ids() -> set[str]:
    """The ids of the nodes Ray counts alive now (a node it lost is dead once its health checks fail)."""
    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


async def placed_node(member: Member, wait_s: float) -> str:
    """The live node a worker's bundle is on, waiting up to `wait_s` while Ray re-places a bundle
    whose node died; `PlacementError` if no live node takes it in time (none has room)."""
    deadline_s = time.monotonic() + wait_s
    while True:
        node_id = placement_group_table(member.group)["bundles_to_node_id"].get(member.bundle_index)
        if node_id in live_node_ids():
            return str(node_id)
        if time.monotonic() > deadline_s:
            bundle = member.group.bundle_specs[member.bundle_index]
            raise PlacementError(
                f"{member.kind} {member.index}: its bundle {bundle} is on no live node after {wait_s:g} s "
                f"(its node was lost and no other has room for it: free resources or add nodes); "
                f"the Ray cluster has {cluster_has(bundle)}"
            )
        await asyncio.sleep(_PLACED_POLL_S)


def release_groups(pool: Pool, *, all_groups: bool = False) -> None:
    """Remove the pool's placement groups that no member uses (every one with `all_groups`)."""
    used = set() if all_groups else {id(m.group) for m in pool.members}
    for group in [g for g in pool.groups if id(g) not in used]:
        pool.groups.remove(group)
        with contextlib.suppress(Exception):
            remove_placement_group(group)


class NodeIps:
    """Node id -> that node's IP, asked of Ray again whenever an id is not known yet."""

    def __init__(self) -> None:
        self.known: dict[str, str] = {}

    def ip(self, node_id: str | None) -> str:
        if node_id not in self.known:
            self.known = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return self.known.get(node_id or "", "127.0.0.1")
