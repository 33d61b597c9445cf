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

logger = logging.getLogger(__name__)


class WorkerActorBase:
    """Owns one engine, its loop thread and one gRPC server; `start` returns "host:port"."""

    role = "worker"

    def __init__(self, engine_config: EngineConfig, store_address: str = "") -> None:
        self.engine_config = engine_config
        self.store_address = store_address
        self.worker_id = f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        self.address: str | None = None
        self._server: grpc.Server | None = None
        self.loop: Any = None
        self.servicer: Any = None  # set by `register_services`; its `close()`, if any, runs at shutdown

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        from splitserve.engine.engine_loop import EngineLoop
        from splitserve.engine.llm_engine import LLMEngine
        from splitserve.rpc import start_server

        self.loop = EngineLoop(LLMEngine(self.engine_config), name=f"{self.role}-engine")
        self._server, self.address, _ = start_server(self.register_services(), host, port)
        logger.info("%s %s serving on %s", self.role, self.worker_id, self.address)
        return self.address

    def register_services(self) -> Callable[[grpc.Server], None]:
        raise NotImplementedError

    def health(self) -> bool:
        return self.loop is not None and self.loop.alive

    def stats(self) -> dict[str, Any]:
        def read(engine) -> dict[str, Any]:  # type: ignore[no-untyped-def]
            sched = engine.scheduler
            return {
                "role": self.role,
                "address": self.address,
                "num_waiting": len(sched.waiting),
                "num_running": len(sched.running),
                "num_reserved": len(sched.reserved),
                "num_free_kv_blocks": sched.blocks.num_free_blocks,
                "num_total_kv_blocks": engine.plan.num_blocks,
                "num_free_state_slots": sched.slots.num_free_slots,
                "num_total_state_slots": engine.plan.num_slots,
                "num_preemptions": sched.num_preemptions,
                # swap preemption (engine/swap_space.py; zeros when preempting by recompute)
                **{f"swap_{k}": v for k, v in dataclasses.asdict(engine.swap_stats()).items()},
            }

        return self.loop.call(read).result(timeout=30)

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
        return num_held

    def _drain(self, timeout_s: float) -> int:
        """Poll the engine (20 times a second) until it holds no request or `timeout_s` passes."""
        if self.loop is None or not self.loop.alive:
            return 0
        deadline_s = time.monotonic() + timeout_s
        while True:
            num_held = self.loop.call(_num_held_requests).result(timeout=30)
            if num_held == 0 or time.monotonic() >= deadline_s:
                return int(num_held)
            time.sleep(0.05)


def _num_held_requests(engine: Any) -> int:
    sched = engine.scheduler
    return len(sched.waiting) + len(sched.running) + len(sched.reserved)
