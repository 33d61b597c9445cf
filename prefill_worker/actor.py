"""The prefill worker actor: an engine in prefill mode behind the Prefill gRPC service."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from splitserve.worker.actor_base import WorkerActorBase


class PrefillWorkerActor(WorkerActorBase):
    """Prefills prompts and streams their state into the store the decode target names."""

    role = "prefill"

    def register_services(self) -> Callable[[grpc.Server], None]:
        from prefill_worker.servicer import PrefillServicer
        from splitserve.v1 import prefill_pb2_grpc

        servicer = self.servicer = PrefillServicer(
            self.loop, self.worker_id, store_address=self.store_address
        )
        return lambda server: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)

    def stats(self) -> dict[str, Any]:
        """The engine's load (see `WorkerActorBase.stats`) and, with the cluster prefix cache on,
        what this worker took from and gave to the stores (`PrefixReuse.counters`)."""
        stats = super().stats()
        prefixes = getattr(self.servicer, "prefixes", None)
        if prefixes is not None:
            stats.update(prefixes.counters())
        return stats
