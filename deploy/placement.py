"""Where the deployment's actors go: placement groups for the pools, and node id -> IP.

Each pool reserves one placement group per start or step that adds replicas (Ray groups
cannot grow), one bundle per replica, or per rank of a tensor-parallel replica (consecutive, on
one node: the worker's actor sits in the first, and starts its other ranks as Ray actors in the
rest, splitserve/engine/parallel/actor_ranks.py); `reserve` waits for it and fails with
`PlacementError` if the cluster cannot give it in time. Before waiting, `check_room` (deploy/room.py) fails at once
when the bundles can never fit. A group is freed only whole, so the bundle of a worker removed
from a group others still use is kept (`vacate`) and handed to the next worker of the same
reservation (`place`): a rolling replacement needs room for one extra bundle, not one per replica.

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
from deploy.members import Member, Pool
from deploy.room import PlacementError, cluster_has, on_labels

HEAD_NODE_RESOURCE = "node:__internal_head__"  # every Ray head node has 1 of it

__all__ = [
    "HEAD_NODE_RESOURCE",
    "NodeIps",
    "PlacementError",
    "live_node_ids",
    "place",
    "placed_node",
    "release_groups",
    "reserve",
    "vacate",
]
_PLACED_POLL_S = 0.2


async def reserve(pool: Pool, count: int, wait_s: float) -> list[Member]:
    """Reserve `count` replicas of the pool's spec in one new placement group, a bundle per rank
    (consecutive; a member names its first); add and return their members (not started yet)."""
    spec = pool.spec
    bundle, labels, ranks = spec.bundle, spec.labels, spec.num_ranks
    group = placement_group(
        [dict(bundle) for _ in range(count * ranks)],
        strategy=spec.placement,
        bundle_label_selector=[dict(labels) for _ in range(count * ranks)] if labels else None,
    )
    try:
        await call(group.ready(), wait_s)
    except asyncio.TimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"pool {pool.name!r}: could not reserve {count} x {bundle}{on_labels(labels)} "
            f"({spec.placement}) within {wait_s:g} s; the Ray cluster has {cluster_has(bundle)}. "
            f"Lower {pool.name}.replicas, num_cpus or num_gpus, free what else holds them, or add nodes."
        ) from None
    nodes = placement_group_table(group)["bundles_to_node_id"]
    split = [i for i in range(count) if len({nodes[i * ranks + r] for r in range(ranks)}) > 1]
    if split:  # PACK spreads what one node cannot hold; a replica's ranks have run on one node only
        remove_placement_group(group)
        raise PlacementError(
            f"pool {pool.name!r}: replica {split[0]}'s {ranks} rank bundles {bundle} landed on different "
            f"nodes; a replica's ranks run on one node: free room for {ranks} on a node, or use STRICT_PACK"
        )
    pool.groups.append(group)
    members = [
        Member(
            kind=pool.role,
            index=pool.next_index + i,
            pool=pool.name,
            node_id=nodes[i * ranks],
            group=group,
            bundle_index=i * ranks,
            spec=spec,
        )
        for i in range(count)
    ]
    pool.next_index += count
    pool.members.extend(members)
    return members


async def place(pool: Pool, count: int, wait_s: float) -> list[Member]:
    """`count` new members of the pool's spec: in vacated bundles that reserve the same first,
    the rest in a new placement group; added to the pool, not started yet."""
    reused = [slot for slot in pool.vacated if pool.spec.same_reservation(slot.spec)][:count]
    members = []
    for slot in reused:
        member = Member(
            kind=pool.role,
            index=pool.next_index,
            pool=pool.name,
            group=slot.group,
            bundle_index=slot.bundle_index,
            spec=pool.spec,
        )
        # Ray re-places a bundle whose node died: the member starts beside its new node's store
        member.node_id = await placed_node(member, wait_s)
        pool.vacated.remove(slot)
        pool.next_index += 1
        pool.members.append(member)
        members.append(member)
    if count > len(reused):
        members += await reserve(pool, count - len(reused), wait_s)
    return members


def vacate(pool: Pool, member: Member) -> None:
    """A worker taken out of the pool: keep its bundle for a successor while its group lives."""
    if member.group is not None:
        pool.vacated.append(member)
    release_groups(pool)


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
    pool.vacated = [slot for slot in pool.vacated if id(slot.group) in used]


class NodeIps:
    """Node id -> that node's IP, asked of Ray again whenever an id is not known yet."""

    def __init__(self) -> None:
        self.known: dict[str, str] = {}

    def ip(self, node_id: str | None) -> str:
        if node_id not in self.known:
            self.known = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return self.known.get(node_id or "", "127.0.0.1")
