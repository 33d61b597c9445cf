"""The decode worker actor: an engine in decode mode behind the Decode gRPC service."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from splitserve.worker.actor_base import WorkerActorBase


class DecodeWorkerActor(WorkerActorBase):
    """Reserves room, pulls transferred state from its node's store, decodes and streams tokens."""

    role = "decode"

    def register_services(self) -> Callable[[grpc.Server], None]:
        from decode_worker.servicer import DecodeServicer
        from splitserve.v1 import decode_pb2_grpc

        if not self.store_address:
            raise ValueError("a decode worker needs the address of its node's state store")
        servicer = self.servicer = DecodeServicer(self.loop, self.worker_id, self.store_address)
        return lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
