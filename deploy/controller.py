"""The controller: one Ray actor that turns a `ClusterConfig` into running actors and keeps them up.

`start()` reserves a placement group per pool, starts one state store on each node that hosts
a worker, then the workers (each given its node's store address), then the gateway, and tells
the gateway the worker addresses. A background loop calls every actor's `health()` (and
`stats()`) every `health.interval_s`, each call allowed `health.timeout_s`; an actor that is
dead, fails the call or does not answer in time is killed and restarted in its own bundle, at
most `health.max_restarts` times, and the gateway hears the new addresses. `resize(pool, n)`
grows or shrinks a pool; `status()` reports everything; `stop()` ends every actor it started.

The actor classes (written in their own packages) are imported only when first needed, so this
module imports without them; `actor_classes` replaces any of them (tests pass doubles there).
Keys: "store", "prefill", "decode", "colocated", "gateway" and "gateway_settings" (the settings
class the gateway's constructor takes).

Run it as `ray.remote(Controller)` (see `deploy.launcher`); it is an async actor, so `status()`
answers while a health pass or a restart is in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from deploy.actors import DEFAULT_CLASSES, StartError, gateway_settings_kwargs, load_actor_class, says_healthy
from deploy.members import Member, Pool, bundle_of
from splitserve.config import ClusterConfig
from splitserve.engine_config import EngineConfig

CONTROLLER_NAME = "splitserve-controller"
NAMESPACE = "splitserve"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # every Ray head node has 1 of it
__all__ = ["CONTROLLER_NAME", "NAMESPACE", "Controller", "PlacementError", "StartError"]


logger = logging.getLogger("splitserve.deploy")


class PlacementError(RuntimeError):
    """A pool's placement group could not be reserved in time: the cluster lacks the resources."""


class Controller:
    """Owns every actor of one deployment: places, starts, watches, restarts, resizes, stops.

    The config is never mutated; the current replica counts live in the pools. Structural
    changes (start, a health pass with its restarts, resize, stop) hold one asyncio lock, so
    they never interleave; `status()` takes no lock.
    """

    def __init__(self, config: ClusterConfig, actor_classes: dict[str, type] | None = None) -> None:
        self._config = config
        self._overrides = dict(actor_classes or {})
        unknown = set(self._overrides) - set(DEFAULT_CLASSES)
        if unknown:
            raise ValueError(
                f"unknown actor_classes keys {sorted(unknown)}; known: {sorted(DEFAULT_CLASSES)}"
            )
        self._classes: dict[str, Any] = {}
        self._pools: dict[str, Pool] = {}
        self._stores: dict[str, Member] = {}  # node id -> that node's store
        self._gateway: Member | None = None
        self._engine_configs: dict[str, EngineConfig] = {}
        self._model_path: str | None = None
        self._published: tuple[list[str], list[str]] | None = None
        self._node_ips: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self._health_task: asyncio.Task[None] | None = None
        self._started = False
        self._stopped = False

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Place and start everything, run one health pass, start the health loop; return status."""
        async with self._lock:
            if self._started:
                raise RuntimeError("the controller has already started")
            self._started = True
            self._model_path = await asyncio.to_thread(self._config.model.resolved_path)
            for name in self._config.pool_names:
                self._engine_configs[name] = self._config.engine_config(name, model_path=self._model_path)
                section = self._config.pool(name)
                self._pools[name] = Pool(name=name, role=self._config.pool_role(name), section=section)
            # Every reservation first, so a cluster that is too small fails before anything runs.
            reserved = [await self._reserve(pool, pool.section.replicas) for pool in self._pools.values()]
            await self._launch([m for members in reserved for m in members])
            self._gateway = Member(kind="gateway", index=0)
            await self._start_gateway(self._gateway)
            await self._publish(force=True)
            await self._check_once()
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        return await self.status()

    async def resize(self, pool: str, replicas: int) -> dict[str, Any]:
        """Grow or shrink one pool to `replicas` workers (at least 1); return status."""
        if pool not in self._pools:
            raise ValueError(f"no pool {pool!r}; pools: {', '.join(self._pools) or 'none (not started)'}")
        if replicas < 1:
            raise ValueError(f"a pool needs at least 1 replica (got {replicas}); stop() ends the cluster")
        async with self._lock:
            target = self._pools[pool]
            current = len(target.members)
            if replicas > current:
                await self._launch(await self._reserve(target, replicas - current))
            elif replicas < current:
                removed = target.members[replicas:]
                del target.members[replicas:]
                await self._publish()  # the gateway stops routing to them before they stop
                drain_s = self._config.health.drain_timeout_s
                await asyncio.gather(*(self._shutdown(m, drain_s) for m in removed))
                self._drop_unused_groups(target)
            await self._publish()
        return await self.status()

    async def stop(self) -> dict[str, int]:
        """Stop the health loop, then the gateway, the workers and the stores; free placements."""
        self._stopped = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        async with self._lock:
            workers = [m for pool in self._pools.values() for m in pool.members]
            stages = [[self._gateway] if self._gateway else [], workers, list(self._stores.values())]
            drain_s = self._config.health.drain_timeout_s
            for stage in stages:  # the gateway drains; after it, the workers hold nothing to wait for
                await asyncio.gather(
                    *(self._shutdown(m, drain_s if m.kind == "gateway" else 0) for m in stage)
                )
            for pool in self._pools.values():
                for group in pool.groups:
                    with contextlib.suppress(Exception):
                        remove_placement_group(group)
                pool.groups.clear()
        return {"stopped_actors": sum(len(stage) for stage in stages)}

    async def status(self) -> dict[str, Any]:
        """Everything at a glance: per pool replicas, addresses, health, restarts and load."""
        ips = self._node_ips
        pools = {name: pool.summary(ips) for name, pool in self._pools.items()}
        gateway = self._gateway.row(ips) if self._gateway else None
        if gateway is not None:
            gateway["url"] = self._gateway_url()
        stores = [store.row(ips) for store in self._stores.values()]
        everything = [gateway, *stores] if gateway else stores
        healthy = (
            self._started
            and not self._stopped
            and all(p["healthy"] for p in pools.values())
            and all(row["healthy"] for row in everything)
        )
        return {
            "mode": self._config.mode,
            "model": self._config.model.served_name,
            "started": self._started,
            "stopped": self._stopped,
            "healthy": healthy,
            "gateway": gateway,
            "pools": pools,
            "stores": stores,
            "published": {"prefill": self._published[0], "decode": self._published[1]}
            if self._published
            else None,
        }

    async def worker_handle(self, pool: str, index: int) -> Any:
        """The actor handle of one worker (by its index in `status()`), or None while it is down."""
        for member in self._pools[pool].members:
            if member.index == index:
                return member.handle
        raise ValueError(f"pool {pool!r} has no worker {index}")

    # ---- placement and starting -----------------------------------------------------------

    async def _reserve(self, pool: Pool, count: int) -> list[Member]:
        """Reserve `count` bundles for `pool` in one new placement group; return their members."""
        bundle = bundle_of(pool.section)
        group = placement_group([dict(bundle) for _ in range(count)], strategy=pool.section.placement)
        wait_s = self._config.health.start_timeout_s
        try:
            await asyncio.wait_for(_awaitable(group.ready()), wait_s)
        except asyncio.TimeoutError:
            remove_placement_group(group)
            raise PlacementError(
                f"pool {pool.name!r}: could not reserve {count} x {bundle} ({pool.section.placement}) "
                f"within {wait_s:g} s; cluster resources {ray.cluster_resources()}, "
                f"available {ray.available_resources()}. Lower {pool.name}.replicas, num_cpus or "
                f"num_gpus, or add nodes."
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

    async def _launch(self, members: list[Member]) -> None:
        """Start the stores these workers need (one per node), then the workers, concurrently."""
        for node_id in dict.fromkeys(m.node_id for m in members if m.node_id):
            await self._ensure_store(node_id)
        await asyncio.gather(*(self._start_worker(m) for m in members))

    async def _ensure_store(self, node_id: str) -> Member:
        store = self._stores.get(node_id)
        if store is None:
            store = Member(kind="store", index=len(self._stores), node_id=node_id)
            self._stores[node_id] = store
            await self._start_store(store)
        return store

    async def _start_store(self, store: Member, port: int = 0) -> None:
        cfg = self._config.store
        assert store.node_id is not None  # a store always belongs to one node
        cls = self._actor_class("store")
        store.handle = cls.options(
            num_cpus=cfg.num_cpus,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(store.node_id, soft=False),
        ).remote(cfg.memory_bytes, cfg.disk.path, cfg.disk.bytes, cfg.lease_s)
        store.address = await self._started_at(store, self._node_ip(store.node_id), port)

    async def _start_worker(self, worker: Member) -> None:
        assert worker.pool is not None
        # A bundle whose node died is re-placed by Ray on another node: look it up again.
        worker.node_id = placement_group_table(worker.group)["bundles_to_node_id"][worker.bundle_index]
        store = await self._ensure_store(worker.node_id)
        section = self._config.pool(worker.pool)
        cls = self._actor_class(worker.kind)
        worker.handle = cls.options(
            num_cpus=section.num_cpus,
            num_gpus=section.num_gpus,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                worker.group, placement_group_bundle_index=worker.bundle_index
            ),
        ).remote(self._engine_configs[worker.pool], store.address)
        worker.address = await self._started_at(worker, self._node_ip(worker.node_id), 0)

    async def _start_gateway(self, gateway: Member) -> None:
        cfg = self._config.gateway
        kwargs = gateway_settings_kwargs(self._config, self._model_path)
        settings = self._actor_class("gateway_settings")(**kwargs)
        cls = self._actor_class("gateway")
        gateway.handle = cls.options(
            num_cpus=cfg.num_cpus, max_restarts=0, resources={HEAD_NODE_RESOURCE: 0.001}
        ).remote(settings)
        gateway.node_id = await self._call(gateway.handle.__ray_call__.remote(_node_id_of_actor), 60)
        gateway.address = await self._started_at(gateway, cfg.host, cfg.port)
        self._published = None  # a new gateway knows no workers yet

    async def _started_at(self, member: Member, host: str, port: int) -> str:
        """Call the new actor's `start(host, port)`; mark it healthy; return its address."""
        timeout_s = self._config.health.start_timeout_s
        try:
            address = await self._call(member.handle.start.remote(host, port), timeout_s)
        except asyncio.TimeoutError:
            raise StartError(
                f"{member.kind} {member.index}: start() did not return within {timeout_s:g} s "
                f"(raise health.start_timeout_s if loading the model takes longer)"
            ) from None
        except Exception as exc:
            raise StartError(f"{member.kind} {member.index} failed to start: {_cause(exc)}") from None
        member.healthy, member.error = True, None
        logger.info("%s %d started at %s", member.kind, member.index, address)
        return str(address)

    # ---- health ---------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self._config.health.interval_s)
            async with self._lock:
                if self._stopped:
                    return
                try:
                    await self._check_once()
                except Exception:  # the loop must outlive any one bad pass
                    logger.exception("health pass failed")

    async def _check_once(self) -> None:
        """Probe every actor at once; restart the failed ones (stores, workers, then gateway)."""
        members = self._members()
        reasons = await asyncio.gather(*(self._probe(m) for m in members))
        for member, reason in zip(members, reasons):
            if reason is not None:
                await self._restart(member, reason)
        await self._publish()

    async def _probe(self, member: Member) -> str | None:
        """None if the actor answered `health()` with a truthy value; else what went wrong."""
        if member.given_up:
            return None
        if member.handle is None:
            return member.error or "not running"
        timeout_s = self._config.health.timeout_s
        try:
            answer = await self._call(member.handle.health.remote(), timeout_s)
            if not says_healthy(answer):
                return f"health() returned {answer!r}"
            if isinstance(answer, dict):  # a health report doubles as the actor's stats
                member.stats = dict(answer)
            if member.kind != "gateway":
                member.stats = dict(await self._call(member.handle.stats.remote(), timeout_s) or {})
        except asyncio.TimeoutError:
            return f"no answer within {timeout_s:g} s"
        except ray.exceptions.RayActorError:
            return "actor died"
        except Exception as exc:
            return f"health check raised {type(exc).__name__}: {exc}"
        return None

    async def _restart(self, member: Member, reason: str) -> None:
        member.healthy, member.error = False, reason
        self._kill(member)
        if member.restarts >= self._config.health.max_restarts:
            member.given_up = True
            member.error = f"{reason}; gave up after {member.restarts} restarts"
            logger.error("%s %d is down for good: %s", member.kind, member.index, member.error)
            return
        member.restarts += 1
        logger.warning(
            "restarting %s %d (%s), restart %d", member.kind, member.index, reason, member.restarts
        )
        try:
            await self._start_again(member)
        except Exception as exc:
            self._kill(member)
            member.healthy, member.error = False, f"{reason}; restart failed: {_cause(exc)}"
            logger.error("%s %d: %s", member.kind, member.index, member.error)

    async def _start_again(self, member: Member) -> None:
        if member.kind == "gateway":
            await self._start_gateway(member)
        elif member.kind == "store":
            old = member.address
            try:  # the same port keeps the workers' store address valid
                await self._start_store(member, port=_port_of(old))
            except Exception as exc:
                logger.warning("store %d: port of %s not reusable (%s)", member.index, old, _cause(exc))
                self._kill(member)
                await self._start_store(member, port=0)
            if member.address != old:  # its workers hold the old address: start them afresh
                for worker in self._workers_on(member.node_id):
                    self._kill(worker)
                    await self._start_worker(worker)
        else:
            await self._start_worker(member)

    async def _publish(self, *, force: bool = False) -> None:
        """Tell the gateway the healthy worker addresses, if they changed since it last heard."""
        gateway = self._gateway
        if gateway is None or not gateway.healthy or gateway.handle is None:
            return
        if self._config.mode == "colocated":
            both = self._pools["prefill"].healthy_addresses
            lists = (both, list(both))
        else:
            lists = (self._pools["prefill"].healthy_addresses, self._pools["decode"].healthy_addresses)
        if not force and lists == self._published:
            return
        try:
            await self._call(gateway.handle.update_workers.remote(*lists), self._config.health.timeout_s)
        except Exception as exc:  # the next health pass finds out what is wrong with the gateway
            logger.warning("update_workers failed: %s", _cause(exc))
            return
        self._published = lists

    # ---- helpers ----------------------------------------------------------------------------

    def _members(self) -> list[Member]:
        workers = [m for pool in self._pools.values() for m in pool.members]
        gateway = [self._gateway] if self._gateway else []
        return [*self._stores.values(), *workers, *gateway]

    def _workers_on(self, node_id: str | None) -> Iterable[Member]:
        return [m for pool in self._pools.values() for m in pool.members if m.node_id == node_id]

    def _drop_unused_groups(self, pool: Pool) -> None:
        used = {id(m.group) for m in pool.members}
        for group in [g for g in pool.groups if id(g) not in used]:
            pool.groups.remove(group)
            with contextlib.suppress(Exception):
                remove_placement_group(group)

    async def _shutdown(self, member: Member, drain_timeout_s: float = 0.0) -> None:
        """Ask the actor to shut down, letting its requests in flight finish for up to
        `drain_timeout_s` first; then kill it whatever it said."""
        if member.handle is not None:
            shutdown = member.handle.shutdown
            call = shutdown.remote(drain_timeout_s=drain_timeout_s) if drain_timeout_s else shutdown.remote()
            with contextlib.suppress(Exception):
                await self._call(call, self._config.health.timeout_s + drain_timeout_s)
        self._kill(member)

    def _kill(self, member: Member) -> None:
        if member.handle is not None:
            with contextlib.suppress(Exception):
                ray.kill(member.handle, no_restart=True)
        member.handle, member.healthy = None, False

    def _actor_class(self, kind: str) -> Any:
        if kind not in self._classes:
            self._classes[kind] = load_actor_class(kind, self._overrides.get(kind))
        return self._classes[kind]

    def _node_ip(self, node_id: str | None) -> str:
        if node_id not in self._node_ips:
            self._node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return self._node_ips.get(node_id or "", "127.0.0.1")

    def _gateway_url(self) -> str | None:
        gateway = self._gateway
        if gateway is None or gateway.address is None:
            return None
        host, _, port = gateway.address.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]"):  # bound to every interface: name the node's own
            host = self._node_ip(gateway.node_id)
        return f"http://{host}:{port}"

    @staticmethod
    async def _call(ref: Any, timeout_s: float) -> Any:
        return await asyncio.wait_for(_awaitable(ref), timeout_s)


async def _awaitable(ref: Awaitable[Any]) -> Any:
    return await ref


def _node_id_of_actor(_self: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def _port_of(address: str | None) -> int:
    if not address or ":" not in address:
        return 0
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else 0


def _cause(exc: BaseException) -> str:
    """The original error inside a Ray task error, as one line."""
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
