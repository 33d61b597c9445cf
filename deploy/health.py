"""Watching the deployment's actors: a probe per actor per pass, restarts for the failed ones."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from deploy.actors import says_healthy
from deploy.calls import call, cause
from deploy.members import Member, Roster
from deploy.placement import live_node_ids
from deploy.publisher import WorkerPublisher
from deploy.starter import ActorStarter
from splitserve.config import HealthConfig

logger = logging.getLogger("splitserve.deploy")

# A worker's stats() answers from its engine's last snapshot at once, even during a step, so a
# stuck engine no longer shows as a probe timeout: its `stats_age_s` (how long the step or command
# in progress has run) shows it. Legitimate steps are long too (a prefill chunk deep into a 32k
# prompt took 17 s on a loaded CPU), so the limit is far past the probe's own timeout.
STUCK_AFTER_TIMEOUTS = 30


class HealthWatcher:
    """Every `interval_s` probes each actor (`health()`, then `stats()`), each call allowed
    `timeout_s`; an actor that is dead, fails a call or does not answer in time, or a worker
    whose engine is stuck (`stats_age_s` over `STUCK_AFTER_TIMEOUTS` x `timeout_s`: one step or
    command has run that long), is killed and started again in its own place, at most
    `max_restarts` times within `restart_window_s` (then it is left down, "given up"), and the
    gateways hear the new addresses. A probe's answers become the member's `stats`. Restarts go
    stores first, then workers, then the ledger, then the gateways.

    A node Ray has lost takes its store out of the roster (nothing can run there again); its
    workers are restarted where Ray re-places their bundles, beside that node's store.
    """

    def __init__(
        self, config: HealthConfig, roster: Roster, starter: ActorStarter, publisher: WorkerPublisher
    ) -> None:
        self.config = config  # an apply may change it between passes
        self._roster = roster
        self._starter = starter
        self._publisher = publisher
        self.stopped = False

    async def watch(self, lock: asyncio.Lock) -> None:
        """Run a pass every `interval_s` under `lock` until `stopped` (or cancelled)."""
        while not self.stopped:
            await asyncio.sleep(self.config.interval_s)
            async with lock:
                if self.stopped:
                    return
                try:
                    await self.check_once()
                except Exception:  # the loop must outlive any one bad pass
                    logger.exception("health pass failed")

    async def check_once(self) -> None:
        """Probe every actor at once; restart the failed ones; tell the gateways what changed."""
        self._drop_stores_of_lost_nodes()
        members = self._roster.members()
        reasons = await asyncio.gather(*(self._probe(m) for m in members))
        for member, reason in zip(members, reasons):
            if reason is not None:
                await self._restart(member, reason)
        await self._publisher.publish()

    def _drop_stores_of_lost_nodes(self) -> None:
        stores = self._roster.stores
        if not stores:
            return  # nothing to drop: no need to ask Ray which nodes live
        lost = set(stores) - live_node_ids()
        for node_id in lost:
            store = stores.pop(node_id)
            self._starter.kill(store)
            logger.warning(
                "node %s is lost: store %d (%s) is dropped; its workers restart where their bundles go",
                node_id,
                store.index,
                store.address,
            )

    async def _probe(self, member: Member) -> str | None:
        """None if the actor answered `health()` with a truthy value; else what went wrong."""
        if member.given_up:
            return None
        if member.handle is None:
            return member.error or "not running"
        timeout_s = self.config.timeout_s
        try:
            answer = await call(member.handle.health.remote(), timeout_s)
            if not says_healthy(answer):
                return f"health() returned {answer!r}"
            if isinstance(answer, dict):  # a health report doubles as the actor's stats
                member.stats = dict(answer)
            if member.kind != "gateway":
                member.stats = dict(await call(member.handle.stats.remote(), timeout_s) or {})
                stuck = stuck_engine(member.stats, timeout_s)
                if stuck is not None:
                    return stuck
        except asyncio.TimeoutError:
            return f"no answer within {timeout_s:g} s"
        except ray.exceptions.RayActorError:
            return "actor died"
        except Exception as exc:
            return f"health check raised {type(exc).__name__}: {exc}"
        return None

    async def _restart(self, member: Member, reason: str) -> None:
        if member.kind == "store" and self._dropped(member):
            return
        member.healthy, member.error = False, reason
        self._starter.kill(member)
        now_s, window_s = time.monotonic(), self.config.restart_window_s
        if window_s > 0:
            member.restart_times_s = [t for t in member.restart_times_s if now_s - t < window_s]
        if len(member.restart_times_s) >= self.config.max_restarts:
            member.given_up = True
            within = f" within {window_s:g} s" if window_s > 0 else ""
            member.error = f"{reason}; gave up after {len(member.restart_times_s)} restarts{within}"
            logger.error("%s %d is down for good: %s", member.kind, member.index, member.error)
            return
        member.restarts += 1
        member.restart_times_s.append(now_s)
        logger.warning(
            "restarting %s %d (%s), restart %d", member.kind, member.index, reason, member.restarts
        )
        try:
            await self._starter.start_again(member)
        except Exception as exc:
            self._starter.kill(member)
            member.healthy, member.error = False, f"{reason}; restart failed: {cause(exc)}"
            logger.error("%s %d: %s", member.kind, member.index, member.error)
            if member.kind == "store":  # Ray may have found its node dead meanwhile
                self._dropped(member)

    def _dropped(self, store: Member) -> bool:
        """Drop the stores of lost nodes; whether `store` was one of them."""
        self._drop_stores_of_lost_nodes()
        return self._roster.stores.get(store.node_id or "") is not store


def stuck_engine(stats: dict[str, Any], timeout_s: float) -> str | None:
    """Why a worker whose `stats()` said this has a stuck engine, or None if it does not."""
    age_s, limit_s = stats.get("stats_age_s"), STUCK_AFTER_TIMEOUTS * timeout_s
    if isinstance(age_s, int | float) and age_s > limit_s:
        return (
            f"engine stuck: the step or command in progress has run {age_s:.0f} s, over {limit_s:g} s "
            f"({STUCK_AFTER_TIMEOUTS} x health.timeout_s)"
        )
    return None
