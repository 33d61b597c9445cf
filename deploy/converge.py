"""Bringing the pools to what the config asks, one step at a time, without failing a request.

Each pool says what it should run (`Pool.spec`, `Pool.replicas`); `Converger.run` compares that
with its members and takes one step, under the controller's lock, until they agree:

1. more members than replicas: drain and remove one (an outdated one first, else the newest);
2. a member of another spec: replace it, one at a time. A new worker starts first (in a bundle a
   removed worker left, or one more reserved beside the pool), the gateway hears of it, and only
   then is the old one drained and removed. Where the cluster has no room for that one extra
   bundle and the new spec reserves what the old did, the old one is drained first and the new
   one starts in its bundle (the pool's other replicas serve meanwhile);
3. fewer members than replicas: start the missing ones together.

"Drain" is the scale-down the controller always did: the worker leaves the gateway's lists first,
then finishes what it holds (up to `health.drain_timeout_s`) before it stops. The lock is taken
per step, so health passes (and their restarts) run between steps. A step that fails undoes what
it started and ends the run; what ran before keeps running, and `progress` says what happened.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from deploy.changes import PoolTarget
from deploy.members import Member, Pool, Roster
from deploy.placement import place, vacate
from deploy.publisher import WorkerPublisher
from deploy.room import PlacementError, check_room, held_resources, take
from deploy.starter import ActorStarter
from splitserve.config import ClusterConfig

logger = logging.getLogger("splitserve.deploy")


@dataclass
class ApplyProgress:
    """The last apply: its plan, the steps taken, the one in progress, and how it ended."""

    in_progress: bool = False
    plan: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    step: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "in_progress": self.in_progress,
            "plan": list(self.plan),
            "done": list(self.done),
            "step": self.step,
            "error": self.error,
        }


@dataclass(frozen=True)
class _Step:
    text: str
    run: Callable[[], Awaitable[None]]


class Converger:
    """Takes the steps that bring each pool's members to its spec and replica count (see the
    module docstring), recording them in `progress` and the controller's log."""

    def __init__(self, roster: Roster, starter: ActorStarter, publisher: WorkerPublisher) -> None:
        self._roster = roster
        self._starter = starter
        self._publisher = publisher
        self.progress = ApplyProgress()

    async def run(self, lock: Any) -> None:
        """Step until every pool matches its spec and count; raise what a failed step raised."""
        try:
            while True:
                async with lock:
                    step = self._next_step()
                    if step is None:
                        return
                    self.progress.step = step.text
                    logger.info("apply: %s", step.text)
                    await step.run()
                    self.progress.done.append(step.text)
                    self.progress.step = None
        except Exception as exc:
            self.progress.error = f"{self.progress.step}: {type(exc).__name__}: {exc}"
            self.progress.step = None
            logger.error("apply stopped: %s", self.progress.error)
            raise
        finally:
            self.progress.in_progress = False

    def _next_step(self) -> _Step | None:
        for pool in self._roster.pools.values():
            outdated = pool.outdated()
            if len(pool.members) > pool.replicas:
                victim = outdated[0] if outdated else pool.members[-1]
                text = f"{pool.name}: drain and remove replica {victim.index}"
                return _Step(text, partial(self._retire, pool, victim))
            if outdated:
                text = f"{pool.name}: replace replica {outdated[0].index}"
                return _Step(text, partial(self._replace, pool, outdated[0]))
            if len(pool.members) < pool.replicas:
                count = pool.replicas - len(pool.members)
                return _Step(f"{pool.name}: add {count} replica(s)", partial(self._add, pool, count))
        return None

    async def _add(self, pool: Pool, count: int) -> None:
        reusable = sum(pool.spec.same_reservation(slot.spec) for slot in pool.vacated)
        if count > reusable:
            check_room(
                pool.name, pool.spec, count - reusable, held_resources(self._starter.config, self._roster)
            )
        added = await self._start(pool, count)
        logger.info(
            "apply: %s: started %s", pool.name, ", ".join(f"replica {m.index} at {m.address}" for m in added)
        )

    async def _replace(self, pool: Pool, old: Member) -> None:
        if self._room_for_one_more(pool):
            (new,) = await self._start(pool, 1)  # surge: the old one serves until the new one does
            logger.info("apply: %s: replica %d started at %s", pool.name, new.index, new.address)
            await self._retire(pool, old)
            return
        if not (pool.spec.same_reservation(old.spec) and len(pool.members) > 1):
            raise PlacementError(
                f"pool {pool.name!r}: no room for one more {pool.spec.bundle} to replace replica {old.index} "
                "beside it, and the new spec cannot take over its bundle; free resources or add a node"
            )
        logger.info("apply: %s: no room for one more replica: replica %d goes first", pool.name, old.index)
        await self._retire(pool, old)
        (new,) = await self._start(pool, 1)  # in the bundle `old` left
        logger.info("apply: %s: replica %d started at %s in its bundle", pool.name, new.index, new.address)

    def _room_for_one_more(self, pool: Pool) -> bool:
        return no_room_for_one_more(self._starter.config, self._roster, pool) is None

    async def _start(self, pool: Pool, count: int) -> list[Member]:
        """Place and start `count` workers of the pool's spec and tell the gateway; undo on failure."""
        wait_s = self._starter.config.health.start_timeout_s
        added = await place(pool, count, wait_s)
        try:
            await self._starter.launch(added)
        except BaseException:
            for member in added:
                self._starter.kill(member)
                pool.members.remove(member)
                vacate(pool, member)  # a reused bundle stays reusable; a new group no one uses goes
            raise
        await self._publisher.publish()
        return added

    async def _retire(self, pool: Pool, member: Member) -> None:
        """Out of the gateway's lists first, then drained and stopped; its bundle kept for a successor."""
        pool.members.remove(member)
        await self._publisher.publish()
        drain_s = self._starter.config.health.drain_timeout_s
        await self._starter.shutdown(member, drain_s)
        vacate(pool, member)
        logger.info("apply: %s: replica %d drained and stopped", pool.name, member.index)


def no_room_for_one_more(config: ClusterConfig, roster: Roster, pool: Pool) -> str | None:
    """Why one more replica of `pool` can never fit the cluster as it stands; None when it may
    (a bundle a removed replica left, or room beside what the deployment holds)."""
    if any(pool.spec.same_reservation(slot.spec) for slot in pool.vacated):
        return None
    try:
        check_room(pool.name, pool.spec, 1, held_resources(config, roster))
    except PlacementError as exc:
        return str(exc)
    return None


def check_room_to_converge(config: ClusterConfig, roster: Roster, targets: list[PoolTarget]) -> None:
    """Raise `PlacementError` before anything changes if the pools cannot reach `targets`.

    Added replicas need room as in a resize; a replaced replica needs one bundle beside the pool
    (its successors then take over the bundles the old ones leave), or, where the new spec reserves
    something else, a bundle for every replaced replica (the old groups are freed only whole). A
    pool of one replica is replaced only beside itself: in its own bundle it would stop serving.
    """
    held = held_resources(config, roster)
    for target in targets:
        pool = roster.pools[target.name]
        outdated = [m for m in pool.members if m.spec != target.spec]
        num_replaced = min(len(outdated), target.replicas)
        need = max(0, target.replicas - len(pool.members))
        if all(target.spec.same_reservation(m.spec) for m in outdated):
            # bundles free for the pool's new workers: vacated ones, and those of removed replicas
            free = sum(target.spec.same_reservation(slot.spec) for slot in pool.vacated)
            free += max(0, len(pool.members) - target.replicas)
            check_room(target.name, target.spec, max(0, need - free), held)
            if num_replaced and need + free == 0 and target.replicas == 1:
                try:
                    check_room(target.name, target.spec, 1, held)
                except PlacementError as exc:
                    raise PlacementError(
                        f"pool {target.name!r} has one replica, which keeps serving only if its "
                        f"successor starts beside it: {exc}"
                    ) from None
        else:  # a new reservation: the old groups hold theirs until their last replica goes
            need += num_replaced
            check_room(target.name, target.spec, need, held)
        take(held, target.spec.bundle, need * target.spec.num_ranks)
