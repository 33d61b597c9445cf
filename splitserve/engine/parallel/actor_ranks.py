"""Ranks 1..N-1 as Ray actors, each in its own bundle of the worker's placement group: the cluster's
launcher.

A tensor-parallel worker's actor is rank 0; `RankActors` starts rank r as a `RankActor` in bundle
`worker_bundle_index + r` (`splitserve.rank_placement.RankPlacement`, from the controller), asking
for the bundle's whole reservation, so with `num_gpus: 1` Ray shows each rank its own GPU (its
CUDA_VISIBLE_DEVICES) and every rank runs on `cuda:0`. The ranks join rank 0's rendezvous store at
rank 0's node IP (NCCL on CUDA, gloo on the CPU) and take the engine's calls over a TCP connection
to the driver, authenticated with a key the driver makes per engine. The worker's actor owns its
rank actors: Ray ends them when it dies, and a rank's death shows in `ended()` as Ray reports it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from splitserve.engine.parallel.rank_process import run_rank
from splitserve.engine.parallel.ranks import RankGone, RankHandle, rank_config
from splitserve.engine_config import EngineConfig
from splitserve.rank_placement import RankPlacement

logger = logging.getLogger(__name__)

# how long the rank actors may take to be placed and answer: a restarted worker's ranks wait for
# the bundles of the ranks it had until Ray has ended them (the controller's start timeout bounds
# the worker's start as a whole)
RANK_START_TIMEOUT_S = 300.0


class RankActor:
    """One rank past rank 0 of a worker's tensor-parallel engine, in its own placement-group bundle.

    `listen` opens a port on its node for the driver's connection (which must present the key the
    driver created it with) and says where the rank runs; `serve` accepts the driver and runs the
    rank (`rank_process.run_rank`) until it is told to stop or the driver's connection closes. A
    rank whose own work fails ends its process, as a rank process does: the driver's collectives
    then fail at once instead of waiting out their timeout, and Ray reports the actor dead.
    """

    def __init__(self, authkey: bytes) -> None:
        self._authkey = authkey
        self._listener: Listener | None = None

    def listen(self) -> dict[str, Any]:
        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=self._authkey)
        context = ray.get_runtime_context()
        return {
            "address": self._listener.address,
            "pid": os.getpid(),
            "actor_id": context.get_actor_id(),
            "node_id": context.get_node_id(),
            "placement_group_id": context.get_placement_group_id(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
        }

    def serve(self) -> None:
        assert self._listener is not None, "serve() follows listen()"
        with self._listener as listener:
            conn = _accept_driver(listener)
        with conn:
            try:
                run_rank(conn)
            except BaseException:
                logger.exception("this rank failed; ending its process")
                logging.shutdown()
                os._exit(1)


def _accept_driver(listener: Listener) -> Connection:
    """The first connection that presents the driver's key (another caller on the port is dropped)."""
    while True:
        try:
            return listener.accept()
        except (AuthenticationError, EOFError, ConnectionError) as exc:
            logger.warning("dropped a connection to this rank that is not its driver's: %s", exc)


@functools.cache
def _remote_rank_actor() -> Any:
    return ray.remote(RankActor)


class ActorRank:
    """A rank's Ray actor and its `serve` call, which completes when the rank's loop ends (or
    fails when the actor dies)."""

    def __init__(self, actor: Any, serving: Any, info: dict[str, Any], bundle_index: int) -> None:
        self.actor = actor
        self.serving = serving
        self.pid: int = info["pid"]
        self._where = {k: v for k, v in info.items() if k not in ("address", "pid")}
        self._where["bundle_index"] = bundle_index
        self._ended: str | None = None

    def ended(self) -> str | None:
        if self._ended is None and ray.wait([self.serving], timeout=0)[0]:
            try:
                ray.get(self.serving)
                self._ended = "ended (its Ray actor's loop returned)"
            except Exception as exc:  # RayActorError: the actor died (killed, or its node lost)
                self._ended = f"ended (its Ray actor died: {type(exc).__name__})"
        return self._ended

    def join(self, timeout_s: float) -> bool:
        return bool(ray.wait([self.serving], timeout=timeout_s)[0])

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)  # frees its bundle for the worker's next start

    def where(self) -> dict[str, Any]:
        return dict(self._where)


class RankActors:
    """Starts a worker's other ranks as Ray actors in the bundles `placement` names."""

    def __init__(self, placement: RankPlacement) -> None:
        self.placement = placement

    def rendezvous_host(self) -> str:
        return str(ray.util.get_node_ip_address())

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        return rank_config(config, rank, own_device=True)

    def start(self, world_size: int) -> tuple[list[RankHandle], list[Connection]]:
        authkey = secrets.token_bytes(32)
        where = self.placement
        actors = [
            _remote_rank_actor()
            .options(
                num_cpus=where.num_cpus,
                num_gpus=where.num_gpus,
                resources=dict(where.resources),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    where.group, placement_group_bundle_index=where.bundle_index(rank)
                ),
            )
            .remote(authkey)
            for rank in range(1, world_size)
        ]
        conns: list[Connection] = []
        try:
            infos = ray.get([actor.listen.remote() for actor in actors], timeout=RANK_START_TIMEOUT_S)
            handles: list[RankHandle] = [
                ActorRank(actor, actor.serve.remote(), info, where.bundle_index(rank))
                for rank, (actor, info) in enumerate(zip(actors, infos), start=1)
            ]
            conns.extend(Client(tuple(info["address"]), authkey=authkey) for info in infos)
        except BaseException as exc:
            for conn in conns:
                conn.close()
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            if isinstance(exc, Exception):
                raise RankGone(
                    f"the rank actors of bundles {where.bundle_index(1)}..{where.bundle_index(world_size - 1)} "
                    f"did not start: {type(exc).__name__}: {exc}"
                ) from exc
            raise
        return handles, conns
