"""The colocated worker actor (`mode: colocated`): one engine prefills and decodes its own
requests, with the Prefill and Decode services on one port. No state moves; this is the
baseline disaggregation is measured against."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from splitserve.worker.actor_base import WorkerActorBase


class ColocatedWorkerActor(WorkerActorBase):
    """One engine that prefills and decodes its own requests; Prefill and Decode on one port."""

    role = "colocated"

    def register_services(self) -> Callable[[grpc.Server], None]:
        from colocated_worker.servicer import ColocatedServicer
        from splitserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

        servicer = self.servicer = ColocatedServicer(self.loop, self.worker_id)

        def register(server: grpc.Server) -> None:
            prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
            decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

        return register
