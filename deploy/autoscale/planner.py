"""The autoscaler's loop in the controller: observe, decide, act through the converge, report.

Every pool with `autoscale` is looked at every `autoscale.interval_s`: the gateways' load
reports become an observation of the window since the last pass (observe.py; a pool's first
pass, and its first after a change, only starts the window), `decide` says up, down, held or
hold (decide.py), and an up or down is carried out by the controller's converge, the path `apply` takes (an
added replica starts and joins the gateway's lists; a removed one leaves them first and
drains, so no request fails). A pool whose members are not its count yet (an apply or a
restart in progress) is not judged. An up that does not fit the cluster is held: the planner
says so, asks Ray's autoscaler for the bundles (resources.py) and tries again after the
cool-down. Each decision is logged with its reason, counted, and sent to the gateways for their
/metrics (frontend/autoscale_metrics.py); `status()` is the "autoscale" part of the
controller's status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deploy.autoscale.decide import Decision, Observation, Track, decide
from deploy.autoscale.observe import GatewayView, observe
from deploy.members import Pool
from splitserve.config import ClusterConfig

logger = logging.getLogger("splitserve.deploy")

IDLE_POLL_S = 5.0  # how often a deployment without autoscaled pools looks whether it has one now


@dataclass
class PlannerHooks:
    """What the planner needs of the controller: the running config and pools, the gateways'
    load reports, where to send its series, whether one more replica fits (None, or why not),
    how to converge a pool to a count, and to ask Ray's autoscaler for what the deployment wants
    (with one more replica of the named pool; None: as it stands)."""

    config: Callable[[], ClusterConfig]
    pools: Mapping[str, Pool]
    reports: Callable[[], Awaitable[list[dict[str, Any]]]]
    publish: Callable[[dict[str, Any]], Awaitable[None]]
    no_room: Callable[[str], str | None]
    scale: Callable[[str, int, str], Awaitable[None]]
    ask_for_room: Callable[[str | None], None]


@dataclass
class _PoolPlan:
    track: Track = field(default_factory=Track)
    view: GatewayView | None = None
    next_at_s: float = 0.0
    last: Decision | None = None
    seen: Observation | None = None
    error: str | None = None


class Planner:
    """Owns each autoscaled pool's track and last decision, and the decision counts; promises
    never to ask a pool for fewer than `min_replicas` or more than `max_replicas`, nor for more
    than fits (see the module docstring)."""

    def __init__(self, hooks: PlannerHooks, clock: Callable[[], float] = time.monotonic) -> None:
        self._hooks = hooks
        self._clock = clock
        self._plans: dict[str, _PoolPlan] = {}
        self.counts: dict[tuple[str, str, str], int] = {}  # (pool, direction, reason) -> decisions
        self._asked = False  # whether Ray's autoscaler holds a request of ours
        self.stopped = False

    async def run(self) -> None:
        """Pass after pass until `stopped` (or cancelled); a failed pass is logged, not fatal."""
        while not self.stopped:
            try:
                await self.pass_once()
            except Exception:
                logger.exception("autoscale pass failed")
            await asyncio.sleep(self._sleep_s())

    def _sleep_s(self) -> float:
        if not self._plans:
            return IDLE_POLL_S
        return min(IDLE_POLL_S, max(0.05, min(p.next_at_s for p in self._plans.values()) - self._clock()))

    def _autoscaled(self) -> dict[str, Any]:
        config = self._hooks.config()
        return {
            name: config.pool(name)
            for name in config.pool_names
            if config.pool(name).autoscale is not None and name in self._hooks.pools
        }

    async def pass_once(self) -> None:
        """Judge every autoscaled pool that is due; act on what `decide` says."""
        sections = self._autoscaled()
        self._plans = {name: self._plans.get(name, _PoolPlan()) for name in sections}
        now_s = self._clock()
        due = [name for name, plan in self._plans.items() if plan.next_at_s <= now_s]
        if not due:
            return
        for name in due:  # a failed pass waits its interval too
            self._plans[name].next_at_s = now_s + sections[name].autoscale.interval_s
        view = GatewayView.of(await self._hooks.reports())
        for name in due:
            section, plan, pool = sections[name], self._plans[name], self._hooks.pools[name]
            if pool.replicas != len(pool.members):
                plan.view = None  # judged afresh once the pool is whole
                continue
            before, plan.view = plan.view, view
            if before is None:  # the window starts here: what came before is another pool's story
                continue
            plan.seen = observe(
                pool.role, view, before, len(pool.members), section.slo, section.max_num_batched_tokens
            )
            await self._judge(name, plan, section, self._clock())
        await self._hooks.publish(self.metrics_state())

    async def _judge(self, name: str, plan: _PoolPlan, section: Any, now_s: float) -> None:
        assert plan.seen is not None
        role = self._hooks.pools[name].role
        decision = decide(role, plan.seen, section.autoscale, section.slo, plan.track, now_s)
        if decision.direction == "up" and decision.reason != "below_min":
            no_room = self._hooks.no_room(name)
            if no_room is not None:
                decision = decide(role, plan.seen, section.autoscale, section.slo, plan.track, now_s, no_room)
        plan.track = decision.track
        repeated = plan.last is not None and (plan.last.direction, plan.last.reason) == (
            decision.direction,
            decision.reason,
        )
        plan.last = decision
        if decision.direction == "hold" or (decision.direction == "held" and repeated):
            return
        key = (name, decision.direction, decision.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        current = plan.seen.num_replicas
        if decision.direction == "held":
            logger.warning("autoscale: %s stays at %d: %s", name, current, decision.detail)
            if decision.reason == "does_not_fit":
                self._ask_for_room(name)
            return
        logger.info(
            "autoscale: %s %s %d -> %d (%s: %s)",
            name,
            decision.direction,
            current,
            decision.desired,
            decision.reason,
            decision.detail,
        )
        plan.error = None
        try:
            await self._hooks.scale(name, decision.desired, f"{decision.reason}: {decision.detail}")
        except Exception as exc:
            plan.error = f"{type(exc).__name__}: {exc}"
            logger.error("autoscale: %s %d -> %d failed: %s", name, current, decision.desired, plan.error)
        plan.track = plan.track.after_change(self._clock())
        plan.view = None  # the window restarts with the new pool
        if self._asked:  # the request stands until replaced: make it what the deployment wants now
            self._ask_for_room(None)

    def _ask_for_room(self, name: str | None) -> None:
        try:
            self._hooks.ask_for_room(name)
            self._asked = True
        except Exception as exc:  # no autoscaler API, or GCS unreachable: the hold stands anyway
            logger.warning("autoscale: could not ask Ray's autoscaler for room: %s", exc)

    def metrics_state(self) -> dict[str, Any]:
        """What the gateways show on /metrics (frontend/autoscale_metrics.py)."""
        pools = self._hooks.pools
        return {
            "decisions": [[*key, count] for key, count in sorted(self.counts.items())],
            "desired": {name: pools[name].replicas for name in self._plans},
            "actual": {name: len(pools[name].members) for name in self._plans},
        }

    def status(self) -> dict[str, Any]:
        """Per autoscaled pool: bounds, desired and actual replicas, what was observed last, the
        last decision and the last failed change."""
        out = {}
        for name, section in self._autoscaled().items():
            plan = self._plans.get(name, _PoolPlan())
            scale, pool, last, seen = section.autoscale, self._hooks.pools[name], plan.last, plan.seen
            out[name] = {
                "min_replicas": scale.min_replicas,
                "max_replicas": scale.max_replicas,
                "desired_replicas": pool.replicas,
                "replicas": len(pool.members),
                "observed": None if seen is None else seen.__dict__,
                "decision": None
                if last is None
                else {"direction": last.direction, "reason": last.reason, "detail": last.detail},
                "error": plan.error,
            }
        return out
