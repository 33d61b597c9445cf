"""What every worker actor shares: build the engine in the actor's process, run its loop, serve gRPC.

The subclasses say which services they register. Plain classes: the controller applies
`ray.remote(...)` with each pool's resources, and tests may run them in-process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import grpc

from splitserve.engine_config import EngineConfig
from splitserve.rank_placement import RankPlacement

logger = logging.getLogger(__name__)


class WorkerActorBase:
    """Owns one engine, its loop thread and one gRPC server; `start` returns "host:port".

    A tensor-parallel engine's other ranks start as Ray actors in the bundles `rank_placement`
    names (the controller passes it); without it (a worker run in-process) as local processes.
    """

    role = "worker"

    def __init__(
        self,
        engine_config: EngineConfig,
        store_address: str = "",
        rank_placement: RankPlacement | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.store_address = store_address
        self.rank_placement = rank_placement
        self.worker_id = f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        self.address: str | None = None
        self._server: grpc.Server | None = None
        self.loop: Any = None
        self.servicer: Any = None  # set by `register_services`; its `close()`, if any, runs at shutdown

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        from splitserve.engine.engine_loop import EngineLoop
        from splitserve.engine.llm_engine import LLMEngine
        from splitserve.rpc import start_server

        launcher = None
        if self.rank_placement is not None and self.engine_config.tensor_parallel_size > 1:
            from splitserve.engine.parallel.actor_ranks import RankActors

            launcher = RankActors(self.rank_placement)
        self.loop = EngineLoop(LLMEngine(self.engine_config, launcher=launcher), name=f"{self.role}-engine")
        self._server, self.address, _ = start_server(self.register_services(), host, port)
        logger.info("%s %s serving on %s", self.role, self.worker_id, self.address)
        return self.address

    def register_services(self) -> Callable[[grpc.Server], None]:
        raise NotImplementedError

    def health(self) -> bool:
        """The engine loop runs and, for a tensor-parallel engine, every other rank does (its Ray
        actor is alive and serving, or its process runs): a worker's ranks are one unit (one
        ended, the controller restarts the worker whole)."""
        if self.loop is None or not self.loop.alive:
            return False
        ranks = self.loop.engine.ranks
        ended = ranks.ended() if ranks is not None else None
        if ended is not None:
            logger.error("%s %s is unhealthy: %s", self.role, self.worker_id, ended)
        return ended is None

    def stats(self) -> dict[str, Any]:
        """The engine's load as of its last step, at once, even while a long step runs (the
        engine loop's snapshot). `stats_age_s` says how far behind the engine it may be: 0 while
        the engine waits for work, else how long its step in progress has run; the controller
        restarts a worker whose age passes its stuck limit (deploy/health.py)."""
        snap = self.loop.snapshot()
        ranks = self.loop.engine.ranks
        return {
            "role": self.role,
            "address": self.address,
            "stats_age_s": self.loop.snapshot_age_s(),
            "num_waiting": snap.num_waiting,
            "num_running": snap.num_running,
            "num_reserved": snap.num_reserved,
            "num_free_kv_blocks": snap.num_free_kv_blocks,
            "num_total_kv_blocks": snap.num_total_kv_blocks,
            "num_free_state_slots": snap.num_free_state_slots,
            "num_total_state_slots": snap.num_total_state_slots,
            # slots in use that no running request or reservation holds: a leak (never freed)
            "num_idle_held_slots": max(
                0,
                snap.num_total_state_slots - snap.num_free_state_slots - snap.num_running - snap.num_reserved,
            ),
            "num_preemptions": snap.num_preemptions,
            # swap preemption (engine/swap_space.py; zeros when preempting by recompute)
            **{f"swap_{k}": v for k, v in dataclasses.asdict(snap.swap).items()},
            # a tensor-parallel worker's other ranks (empty with one rank): their pids, and each
            # rank's pid, Ray actor id, placement group, bundle, node and GPUs
            "rank_pids": [handle.pid for handle in ranks.handles] if ranks else [],
            "ranks": ranks.describe() if ranks else [],
            # handed-off pieces rank 0 cut and sent to its other ranks (0 where each reads the store)
            "rank_forwarded_pieces": self.loop.engine.num_forwarded_pieces,
        }

    def shutdown(self, drain_timeout_s: float = 0.0) -> int:
        """Stop serving. With `drain_timeout_s` (a scale-down: the gateway already routes
        elsewhere), first let the requests this engine holds (waiting, running or reserved)
        finish, up to that long; returns how many it still held when it stopped."""
        num_held = self._drain(drain_timeout_s) if drain_timeout_s > 0 else 0
        if self._server is not None:
            self._server.stop(grace=1.0).wait(5)
            self._server = None
        close = getattr(self.servicer, "close", None)
        if close is not None:
            close()  # the channels it opened (to state stores)
        if self.loop is not None:
            self.loop.stop()
            if not self.loop.alive:  # the loop thread is out of the engine: end its other ranks
                self.loop.engine.shutdown()
        return num_held

    def __ray_shutdown__(self) -> None:
        """Ray ends an actor whose handles are all dropped gracefully (even after `ray.kill`,
        when that path wins the race, as on a controller's restart), and Python's exit then waits
        for the gRPC server's handler threads: an open Decode stream kept the replaced worker's
        process, its streams and its device memory for as long as its request ran, and a stream
        whose engine had died, for ever. Stop at once instead: every open RPC ends (the gateway
        fails its streams over), then the engine and its other ranks."""
        self.shutdown()

    def _drain(self, timeout_s: float) -> int:
        """Poll the engine's snapshot (20 times a second) until it holds no request or
        `timeout_s` passes (a step in progress delays neither the poll nor the deadline)."""
        if self.loop is None:
            return 0
        deadline_s = time.monotonic() + timeout_s
        while self.loop.alive:  # a dead engine holds nothing that can still finish
            num_held = self.loop.snapshot().num_held_requests
            if num_held == 0 or time.monotonic() >= deadline_s:
                return num_held
            time.sleep(0.05)
        return 0
