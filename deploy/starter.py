"""Creating the deployment's actors in their places, calling their `start()`, and ending them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deploy.actors import DEFAULT_CLASSES, StartError, load_actor_class
from deploy.calls import call, cause
from deploy.gateway_starter import GatewayStarter
from deploy.members import Member, Roster
from deploy.placement import NodeIps, placed_node
from deploy.worker_spec import WorkerSpec
from splitserve.config import ClusterConfig
from splitserve.rank_placement import RankPlacement

logger = logging.getLogger("splitserve.deploy")

# A worker created while its node was being lost lands where Ray re-places its bundle, beside
# another store than the one it was given: it is started again there, this many times at most.
MAX_MOVES = 2


class _Moved(Exception):
    """The new actor runs on another node than the one whose store it was given."""


class ActorStarter:
    """Starts and ends the actors of one deployment, recording them in its `Roster`.

    Owns the actor classes (loaded on first use; `overrides` replaces any kind, see
    deploy/actors.py) and the model path, resolved once in `prepare`; each worker is built from
    its own `WorkerSpec` (deploy/worker_spec.py); the gateways and their ledger through
    `gateways` (deploy/gateway_starter.py). Every worker gets the address of its own
    node's store, which is started first; a member whose `start()` fails or overruns
    `health.start_timeout_s` raises `StartError` naming it. Every actor is handed the
    deployment's `cluster_token` (splitserve.rpc_auth) through Ray before its `start()`, so its
    gRPC servers refuse callers from outside the deployment and its channels are let in.
    """

    def __init__(
        self,
        config: ClusterConfig,
        roster: Roster,
        node_ips: NodeIps,
        overrides: dict[str, type] | None,
        cluster_token: str,
    ) -> None:
        self.config = config  # the one the controller applies now (an apply changes only what may change)
        self._token = cluster_token
        self._roster = roster
        self._node_ips = node_ips
        self._overrides = dict(overrides or {})
        unknown = set(self._overrides) - set(DEFAULT_CLASSES)
        if unknown:
            raise ValueError(
                f"unknown actor_classes keys {sorted(unknown)}; known: {sorted(DEFAULT_CLASSES)}"
            )
        self._classes: dict[str, Any] = {}
        self.model_path: str | None = None
        self.gateways = GatewayStarter(self, roster)

    async def prepare(self) -> None:
        """Resolve the model path (the embedded model may be built here)."""
        self.model_path = await asyncio.to_thread(self.config.model.resolved_path)

    def spec(self, config: ClusterConfig, pool: str) -> WorkerSpec:
        """What a worker of `pool` runs under `config` (the model path resolved in `prepare`)."""
        return WorkerSpec.of(config.pool(pool), config.engine_config(pool, model_path=self.model_path))

    async def launch(self, workers: list[Member]) -> None:
        """Start the stores these workers need (one per node), then the workers, concurrently."""
        for node_id in dict.fromkeys(m.node_id for m in workers if m.node_id):
            await self.ensure_store(node_id)
        await asyncio.gather(*(self.start_worker(m) for m in workers))

    async def ensure_store(self, node_id: str) -> Member:
        """The node's store, started first if it has none yet."""
        store = self._roster.stores.get(node_id)
        if store is None:
            index = max((s.index for s in self._roster.stores.values()), default=-1) + 1
            store = Member(kind="store", index=index, node_id=node_id)
            self._roster.stores[node_id] = store
            await self.start_store(store)
        return store

    async def start_store(self, store: Member, port: int = 0) -> None:
        cfg = self.config.store
        assert store.node_id is not None  # a store always belongs to one node
        cls = self.actor_class("store")
        # named only when set, so an actor class without the argument (a test's fake) still fits
        engine = {} if cfg.transfer_engine == "none" else {"transfer_engine": cfg.transfer_engine}
        store.handle = cls.options(
            num_cpus=cfg.num_cpus,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(store.node_id, soft=False),
        ).remote(cfg.memory_bytes, cfg.disk.path, cfg.disk.bytes, cfg.lease_s, **engine)
        store.address = await self.started_at(store, self._node_ips.ip(store.node_id), port)

    async def start_worker(self, worker: Member) -> None:
        """Create the worker in its bundle beside its node's store and start it. A bundle whose
        node died is waited for until Ray re-places it on a live node, whose store it then gets."""
        assert worker.pool is not None
        spec = worker.spec
        assert spec is not None  # a worker is placed for a spec
        cls = self.actor_class(worker.kind)
        # a tensor-parallel worker's other ranks: Ray actors it starts in the bundles after its own
        # (named only then, so a worker class without the argument, a test's fake, still fits)
        ranks = {"rank_placement": rank_placement(worker, spec)} if spec.num_ranks > 1 else {}
        for _ in range(MAX_MOVES + 1):
            node_id = await placed_node(worker, self.config.health.start_timeout_s)
            store = await self.ensure_store(node_id)
            worker.handle = cls.options(
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
                resources=dict(spec.resources),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    worker.group, placement_group_bundle_index=worker.bundle_index
                ),
            ).remote(spec.engine, store.address, **ranks)
            try:
                worker.address = await self.started_at(worker, self._node_ips.ip(node_id), 0, on_node=node_id)
                return
            except _Moved:
                logger.warning(
                    "%s %d landed off node %s as that node was lost: starting it again",
                    worker.kind,
                    worker.index,
                    node_id,
                )
                self.kill(worker)
        raise StartError(
            f"{worker.kind} {worker.index}: its bundle moved between nodes {MAX_MOVES + 1} times while it started"
        )

    async def start_again(self, member: Member) -> None:
        """Start a member that died, in its own place: a store on its node (on its old port if it
        can, else its workers start afresh with the new address), a worker in its bundle, a
        gateway on its node and port, the ledger (handed to the gateways running)."""
        if member.kind == "gateway":
            await self.gateways.start_gateway(member)
        elif member.kind == "ledger":
            await self.gateways.start_ledger(member)
        elif member.kind == "store":
            old = member.address
            try:  # the same port keeps the workers' store address valid
                await self.start_store(member, port=_port_of(old))
            except Exception as exc:
                logger.warning("store %d: port of %s not reusable (%s)", member.index, old, cause(exc))
                self.kill(member)
                await self.start_store(member, port=0)
            if member.address != old:  # its workers hold the old address: start them afresh
                for worker in self._roster.workers_on(member.node_id):
                    self.kill(worker)
                    await self.start_worker(worker)
        else:
            await self.start_worker(member)

    async def shutdown(self, member: Member, drain_timeout_s: float = 0.0) -> None:
        """Ask the actor to shut down, letting its requests in flight finish for up to
        `drain_timeout_s` first; then kill it whatever it said."""
        if member.handle is not None:
            shutdown = member.handle.shutdown
            ref = shutdown.remote(drain_timeout_s=drain_timeout_s) if drain_timeout_s else shutdown.remote()
            with contextlib.suppress(Exception):
                await call(ref, self.config.health.timeout_s + drain_timeout_s)
        self.kill(member)

    def kill(self, member: Member) -> None:
        if member.handle is not None:
            with contextlib.suppress(Exception):
                ray.kill(member.handle, no_restart=True)
            if member.kind == "gateway":
                self.gateways.forget(member)
                member.stats = {}  # its own_address was the dead process's
        member.handle, member.healthy = None, False

    async def started_at(self, member: Member, host: str, port: int, on_node: str | None = None) -> str:
        """Learn the new actor's node and pid, call its `start(host, port)`, mark it healthy;
        return its address. `_Moved` when it runs elsewhere than `on_node` (then not started)."""
        timeout_s = self.config.health.start_timeout_s
        try:
            await call(member.handle.__ray_call__.remote(_hold_cluster_token, self._token), timeout_s)
            where = member.handle.__ray_call__.remote(_node_and_pid_of_actor)
            member.node_id, member.pid = await call(where, timeout_s)
            if on_node is not None and member.node_id != on_node:
                raise _Moved
            address = await call(member.handle.start.remote(host, port), timeout_s)
        except _Moved:
            raise
        except asyncio.TimeoutError:
            raise StartError(
                f"{member.kind} {member.index}: start() did not return within {timeout_s:g} s "
                f"(raise health.start_timeout_s if loading the model takes longer)"
            ) from None
        except Exception as exc:
            raise StartError(f"{member.kind} {member.index} failed to start: {cause(exc)}") from None
        member.healthy, member.error = True, None
        logger.info("%s %d started at %s", member.kind, member.index, address)
        return str(address)

    def actor_class(self, kind: str) -> Any:
        if kind not in self._classes:
            self._classes[kind] = load_actor_class(kind, self._overrides.get(kind))
        return self._classes[kind]


def rank_placement(worker: Member, spec: WorkerSpec) -> RankPlacement:
    """The bundles of the worker's ranks 1..N-1: those after its own in its group, each reserving
    what the worker's does."""
    return RankPlacement(
        group=worker.group,
        worker_bundle_index=worker.bundle_index,
        num_cpus=spec.num_cpus,
        num_gpus=spec.num_gpus,
        resources=spec.resources,
    )


def _hold_cluster_token(_self: Any, token: str) -> None:
    """Runs in the actor's process: its servers and channels from now on require and send `token`."""
    from splitserve.rpc_auth import set_cluster_token

    set_cluster_token(token)


def _node_and_pid_of_actor(_self: Any) -> tuple[str, int]:
    return ray.get_runtime_context().get_node_id(), os.getpid()


def _port_of(address: str | None) -> int:
    if not address or ":" not in address:
        return 0
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else 0
