"""The decode worker actor: an engine in decode mode behind the Decode gRPC service."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from splitserve.worker.actor_base import WorkerActorBase

if TYPE_CHECKING:  # the engine side is imported where the actor runs, not where it is named
    from decode_worker.replay_publisher import ReplayStorePublisher
    from decode_worker.swap_space import StoreSwapSpace
    from splitserve.worker.prefix_store.publisher import PrefixPublisher


class DecodeWorkerActor(WorkerActorBase):
    """Reserves room, pulls transferred state from its node's store, decodes and streams tokens."""

    role = "decode"
    prefix_publisher: PrefixPublisher | None = None  # with prefix caching on: set when started
    replay_publisher: ReplayStorePublisher | None = None  # with decode.replay_window > 0: set when started
    swap_space: StoreSwapSpace | None = None  # with preemption_mode swap: set when started

    def register_services(self) -> Callable[[grpc.Server], None]:
        from decode_worker.replay_publisher import ReplayStorePublisher
        from decode_worker.servicer import DecodeServicer
        from decode_worker.swap_space import attach_store_swap_space
        from splitserve.v1 import decode_pb2_grpc
        from splitserve.worker.prefix_store.publisher import PrefixPublisher

        if not self.store_address:
            raise ValueError("a decode worker needs the address of its node's state store")
        # each request's state stays in the store as it decodes: a failover resumes from it
        self.replay_publisher = ReplayStorePublisher.attach(self.loop, self.worker_id, self.store_address)
        servicer = self.servicer = DecodeServicer(
            self.loop, self.worker_id, self.store_address, publisher=self.replay_publisher
        )
        # a finished request's prompt + reply goes to the store: the conversation's next turn hits;
        # each publish waits out the prompt (a next turn's) this engine is computing, if any
        self.prefix_publisher = PrefixPublisher.attach(
            self.loop, self.worker_id, self.store_address, yield_to_prefills=True
        )
        # a swap-preempted request's state waits in the store, not in this process
        self.swap_space = attach_store_swap_space(self.loop, self.worker_id, self.store_address)
        return lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["worker_id"] = self.worker_id  # the owner of the state it keeps in its store
        if self.servicer is not None:
            out["cross_node_transport"] = self.servicer.cross_node_transport
        if self.replay_publisher is not None:  # what keeping state for failover costs
            out["replay"] = dataclasses.asdict(self.replay_publisher.stats)
        if self.swap_space is not None:
            out["swap_store"] = dataclasses.asdict(self.swap_space.stats)
        if self.prefix_publisher is not None:  # the finished turns it gave its store
            out.update(self.prefix_publisher.stats.counters())
        return out

    def shutdown(self, drain_timeout_s: float = 0.0) -> int:
        num_held = self._drain(drain_timeout_s) if drain_timeout_s > 0 else 0
        publisher, self.prefix_publisher = self.prefix_publisher, None
        if publisher is not None:
            publisher.detach(self.loop)
        replay, self.replay_publisher = self.replay_publisher, None
        if replay is not None:
            replay.detach(self.loop)
        num_held += super().shutdown(0.0)
        swap, self.swap_space = self.swap_space, None
        if swap is not None:  # the loop has stopped: no step swaps any more
            swap.close()
        return num_held
