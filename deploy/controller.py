"""The controller: one Ray actor that turns a `ClusterConfig` into running actors and keeps them up.

`start()` reserves a placement group per pool, starts one state store on each node that hosts
a worker, then the workers (each given its node's store address), then the gateway processes
(with several, first the admission ledger they share: deploy/gateway_starter.py), and tells
every gateway the worker addresses. A background loop probes every actor every
`health.interval_s` and restarts the failed ones. `apply(config)` converges the running
deployment on a new config (pools grown, shrunk or rolled; what cannot change live refused
before anything changes); `resize(pool, n)` is an apply of one pool's replica count;
`status()` reports everything; `stop()` ends every actor it started.

The work is split by responsibility: deploy/room.py (can the bundles ever fit),
deploy/placement.py (placement groups, node IPs), deploy/starter.py (creating, starting and
ending actors), deploy/gateway_starter.py (the gateway processes and their ledger),
deploy/health.py (probes and restarts), deploy/publisher.py (the gateways' worker lists), deploy/changes.py (what a new config changes, what it may not),
deploy/converge.py (the steps of an apply), deploy/autoscale/ (the SLO autoscaler's planner,
which acts through the same converge), deploy/status.py (the status report); this class
composes them.

The actor classes (written in their own packages) are imported only when first needed, so this
module imports without them; `actor_classes` replaces any of them (tests pass doubles there).
Keys: "store", "prefill", "decode", "colocated", "gateway" and "gateway_settings" (the settings
class the gateway's constructor takes).

Run it as `ray.remote(Controller)` (see `deploy.launcher`); it is an async actor, so `status()`
answers while a health pass, a restart or an apply is in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from deploy.actors import StartError, gateway_settings_kwargs
from deploy.autoscale.planner import Planner, PlannerHooks
from deploy.autoscale.resources import ask_ray_for, wanted_bundles
from deploy.calls import call
from deploy.changes import PoolTarget, changed_keys, describe_plan, refusals
from deploy.converge import ApplyProgress, Converger, check_room_to_converge, no_room_for_one_more
from deploy.health import HealthWatcher
from deploy.members import Pool, Roster
from deploy.placement import HEAD_NODE_RESOURCE, NodeIps, release_groups, reserve
from deploy.publisher import WorkerPublisher
from deploy.room import PlacementError, check_start_room
from deploy.starter import ActorStarter
from deploy.status import build_status
from splitserve.config import ClusterConfig, ConfigError, parse_config
from splitserve.rpc_auth import new_cluster_token

CONTROLLER_NAME = "splitserve-controller"
NAMESPACE = "splitserve"
__all__ = [
    "CONTROLLER_NAME",
    "HEAD_NODE_RESOURCE",
    "NAMESPACE",
    "ApplyRefused",
    "Controller",
    "PlacementError",
    "StartError",
]


logger = logging.getLogger("splitserve.deploy")


class ApplyRefused(ValueError):
    """A config the running deployment cannot take: nothing was changed; the message says why."""


class Controller:
    """Owns every actor of one deployment: places, starts, watches, restarts, applies, stops.

    A config is never mutated: an apply replaces the controller's config with the new one, and
    the pools say what they should run (`Pool.spec`, `Pool.replicas`) beside what runs. Structural
    changes (start, a health pass with its restarts, each step of an apply, stop) hold one
    asyncio lock, so they never interleave; one apply runs at a time; `status()` takes no lock.
    """

    def __init__(
        self,
        config: ClusterConfig,
        actor_classes: dict[str, type] | None = None,
        cluster_token: str | None = None,
    ) -> None:
        _log_to_stderr()
        self._config = config
        self._roster = Roster()
        self._node_ips = NodeIps()
        # The deployment's shared secret for internal gRPC (splitserve.rpc_auth); never logged.
        self._token = cluster_token or new_cluster_token()
        self._starter = ActorStarter(config, self._roster, self._node_ips, actor_classes, self._token)
        self._publisher = WorkerPublisher(config.mode, self._roster, config.health.timeout_s)
        self._health = HealthWatcher(config.health, self._roster, self._starter, self._publisher)
        self._converger = Converger(self._roster, self._starter, self._publisher)
        self._applying = False
        self._lock = asyncio.Lock()
        self._health_task: asyncio.Task[None] | None = None
        self._planner = Planner(
            PlannerHooks(
                config=lambda: self._config,
                pools=self._roster.pools,
                reports=self._gateway_load_reports,
                publish=self._publish_autoscale,
                no_room=lambda name: no_room_for_one_more(
                    self._config, self._roster, self._roster.pools[name]
                ),
                scale=self._scale_by_planner,
                ask_for_room=self._ask_ray_for_room,
            )
        )
        self._planner_task: asyncio.Task[None] | None = None
        self._started = False
        self._stopped = False

    async def start(self) -> dict[str, Any]:
        """Place and start everything, run one health pass, start the health loop; return status."""
        async with self._lock:
            if self._started:
                raise RuntimeError("the controller has already started")
            self._started = True
            await self._starter.prepare()
            for name in self._config.pool_names:
                self._roster.pools[name] = Pool(
                    name=name,
                    role=self._config.pool_role(name),
                    spec=self._starter.spec(self._config, name),
                    replicas=self._config.pool(name).replicas,
                )
            pools = list(self._roster.pools.values())
            check_start_room(self._config, pools)
            # Every reservation first, so a cluster that is too small fails before anything runs.
            wait_s = self._config.health.start_timeout_s
            reserved = [await reserve(pool, pool.replicas, wait_s) for pool in pools if pool.replicas]
            await self._starter.launch([m for members in reserved for m in members])
            self._starter.gateways.plan()
            await self._starter.gateways.start_all()
            await self._publisher.publish(force=True)
            await self._health.check_once()
        self._health_task = asyncio.get_running_loop().create_task(self._health.watch(self._lock))
        self._planner_task = asyncio.get_running_loop().create_task(self._planner.run())
        return await self.status()

    async def apply(self, config: ClusterConfig, dry_run: bool = False) -> dict[str, Any]:
        """Converge the running deployment on `config`; return {"plan": [...], "status": ...}.

        Before anything changes it raises `ApplyRefused` naming everything that cannot change
        live (deploy/changes.py) or that another apply runs, and `PlacementError` when the new
        replicas can never fit. Then each pool is brought to the new spec and count, one step at
        a time (deploy/converge.py): added replicas start, removed ones are drained first, and a
        pool whose spec changed is replaced one replica at a time, the new one serving before the
        old one is drained, so no request fails. `health` settings take effect at once. With
        `dry_run` it only returns the plan. `status()["apply"]` shows the steps as they go.
        """
        if not self._started or self._stopped:
            raise ApplyRefused("the deployment is not running")
        if self._applying:
            raise ApplyRefused(
                f"another apply is in progress ({self._converger.progress.step or 'planning'}); wait for it "
                "to end (`splitserve status` shows its steps)"
            )
        found = refusals(self._config, config, self._gateway_settings)
        if found:
            raise ApplyRefused("nothing was changed; " + " | ".join(found))
        targets = [
            PoolTarget(name, self._starter.spec(config, name), self._replicas_to_apply(config, name))
            for name in config.pool_names
        ]
        check_room_to_converge(self._config, self._roster, targets)
        plan = describe_plan(self._roster.pools, targets)
        plan += [
            f"{change} (at once)" for change in changed_keys(self._config.health, config.health, "health")
        ]
        if dry_run:
            return {"plan": plan, "status": await self.status()}
        self._applying = True
        try:
            async with self._lock:
                self._use_config(config, targets)
            self._converger.progress = ApplyProgress(in_progress=True, plan=plan)
            logger.info("apply: %s", "; ".join(plan) or "nothing to change")
            await self._converger.run(self._lock)
            logger.info("apply: done")
        finally:
            self._applying = False
        return {"plan": plan, "status": await self.status()}

    async def resize(self, pool: str, replicas: int) -> dict[str, Any]:
        """Grow or shrink one pool to `replicas` workers; return status.

        An apply of the running config with that pool's count changed (validated as a config:
        at least 1, or 0 for a prefill pool that falls back to `decode_local`): growing fails at
        once with `PlacementError` when the new replicas can never fit; shrinking drains.
        """
        pools = self._roster.pools
        if pool not in pools:
            raise ValueError(f"no pool {pool!r}; pools: {', '.join(pools) or 'none (not started)'}")
        scale = self._config.pool(pool).autoscale
        if scale is not None:
            raise ValueError(
                f"pool {pool!r} is autoscaled ({scale.min_replicas}..{scale.max_replicas} replicas): change "
                f"{pool}.autoscale's bounds with `splitserve apply`, or remove its autoscale section"
            )
        data = self._config.model_dump(mode="json")
        data[pool]["replicas"] = replicas
        try:
            config = parse_config(data, source=f"resize {pool} {replicas}")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        result = await self.apply(config)
        return result["status"]  # type: ignore[no-any-return]

    def _replicas_to_apply(self, config: ClusterConfig, name: str) -> int:
        """The count an apply asks of a pool: the config's, or for an autoscaled pool that runs,
        the planner's current count brought within the new bounds (its `replicas` is where it
        starts at `up`)."""
        section, pool = config.pool(name), self._roster.pools.get(name)
        if section.autoscale is None or pool is None:
            return section.replicas
        return section.autoscale.clamp(pool.replicas)

    async def _scale_by_planner(self, name: str, replicas: int, reason: str) -> None:
        """The autoscaler's change: one pool to `replicas`, through the converge `apply` uses."""
        if self._applying or self._stopped:
            raise ApplyRefused("an apply is in progress or the deployment stops; the autoscaler waits")
        self._applying = True
        try:
            pool = self._roster.pools[name]
            text = f"autoscale: {name} {pool.replicas} -> {replicas} ({reason})"
            async with self._lock:
                pool.replicas = replicas
            self._converger.progress = ApplyProgress(in_progress=True, plan=[text])  # the planner logged it
            try:
                await self._converger.run(self._lock)
            except Exception:
                async with self._lock:  # what started stays; the pool asks no more than it runs
                    pool.replicas = len(pool.members)
                raise
        finally:
            self._applying = False

    async def _gateway_load_reports(self) -> list[dict[str, Any]]:
        """Every gateway process's load report; raises unless all answer (a missing one would
        make the load look smaller than it is)."""
        gateways = self._roster.gateways
        down = [g.index for g in gateways if g.handle is None]
        if not gateways or down:
            raise RuntimeError(f"gateway(s) {down or 'none'} down: no whole load to judge the pools by")
        timeout_s = self._config.health.timeout_s
        return list(await asyncio.gather(*(call(g.handle.load_report.remote(), timeout_s) for g in gateways)))

    async def _publish_autoscale(self, state: dict[str, Any]) -> None:
        """The planner's series to every running gateway process's /metrics."""
        timeout_s = self._config.health.timeout_s
        running = [g for g in self._roster.gateways if g.handle is not None]
        await asyncio.gather(*(call(g.handle.publish_autoscale.remote(state), timeout_s) for g in running))

    def _ask_ray_for_room(self, name: str | None) -> None:
        more = {name: 1} if name is not None else {}
        ask_ray_for(wanted_bundles(self._config, self._roster, more))

    def _use_config(self, config: ClusterConfig, targets: list[PoolTarget]) -> None:
        """From now on `config` is what the deployment should be: the pools' targets, the health settings."""
        self._config = self._starter.config = config
        self._health.config = config.health
        self._publisher.timeout_s = config.health.timeout_s
        for target in targets:
            pool = self._roster.pools[target.name]
            pool.spec, pool.replicas = target.spec, target.replicas

    def _gateway_settings(self, config: ClusterConfig) -> dict[str, Any]:
        return gateway_settings_kwargs(config, self._starter.model_path)

    async def stop(self) -> dict[str, int]:
        """Stop the autoscaler and the health loop, then the gateways, the workers, the stores and
        the ledger; free placements."""
        self._stopped = self._health.stopped = self._planner.stopped = True
        for task in (self._planner_task, self._health_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        async with self._lock:
            ledger = [self._roster.ledger] if self._roster.ledger else []
            stages = [
                list(self._roster.gateways),
                self._roster.workers(),
                [*self._roster.stores.values(), *ledger],
            ]
            drain_s = self._config.health.drain_timeout_s
            for stage in stages:  # the gateways drain; after them, the workers hold nothing to wait for
                await asyncio.gather(
                    *(self._starter.shutdown(m, drain_s if m.kind == "gateway" else 0) for m in stage)
                )
            for target in self._roster.pools.values():
                release_groups(target, all_groups=True)
        return {"stopped_actors": sum(len(stage) for stage in stages)}

    async def status(self) -> dict[str, Any]:
        """Everything at a glance (the shape is in deploy/README.md, "Status as JSON")."""
        return build_status(
            self._roster,
            mode=self._config.mode,
            model=self._config.model.served_name,
            started=self._started,
            stopped=self._stopped,
            published=self._publisher.published,
            node_ips=self._node_ips,
            apply=self._converger.progress.to_dict(),
            autoscale=self._planner.status(),
        )

    async def cluster_token(self) -> str:
        """The deployment's internal gRPC token, for a driver attached to this Ray cluster that calls
        workers or stores directly (it could already run code in any actor). Never log it."""
        return self._token

    async def worker_handle(self, pool: str, index: int) -> Any:
        """The actor handle of one worker (by its index in `status()`), or None while it is down."""
        for member in self._roster.pools[pool].members:
            if member.index == index:
                return member.handle
        raise ValueError(f"pool {pool!r} has no worker {index}")


def _log_to_stderr() -> None:
    """The controller's INFO lines (actors started, each step of an apply) and worse go to its
    stderr, which Ray keeps in the controller's log file and forwards to the driver: `up` prints
    them. (Without a handler, Python shows only warnings.)"""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
