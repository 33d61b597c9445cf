"""The decode worker actor: an engine in decode mode behind the Decode gRPC service."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from splitserve.worker.actor_base import WorkerActorBase

if TYPE_CHECKING:  # the engine side is imported where the actor runs, not where it is named
    from splitserve.engine.prefix_store.publisher import PrefixPublisher


class DecodeWorkerActor(WorkerActorBase):
    """Reserves room, pulls transferred state from its node's store, decodes and streams tokens."""

    role = "decode"
    prefix_publisher: PrefixPublisher | None = None  # with prefix caching on: set when started

    def register_services(self) -> Callable[[grpc.Server], None]:
        from decode_worker.servicer import DecodeServicer
        from splitserve.engine.prefix_store.publisher import PrefixPublisher
        from splitserve.v1 import decode_pb2_grpc

        if not self.store_address:
            raise ValueError("a decode worker needs the address of its node's state store")
        servicer = self.servicer = DecodeServicer(self.loop, self.worker_id, self.store_address)
        # a finished request's prompt + reply goes to the store: the conversation's next turn hits
        self.prefix_publisher = PrefixPublisher.attach(self.loop, self.worker_id, self.store_address)
        return lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

    def shutdown(self, drain_timeout_s: float = 0.0) -> int:
        num_held = self._drain(drain_timeout_s) if drain_timeout_s > 0 else 0
        publisher, self.prefix_publisher = self.prefix_publisher, None
        if publisher is not None:
            publisher.detach(self.loop)
        return num_held + super().shutdown(0.0)
