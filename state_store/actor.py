"""The per-node store as a Ray actor: `StateStoreActor`, and get-or-create for the current node."""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from state_store.info import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore

ACTOR_NAME_PREFIX = "splitserve-store-"


def store_actor_name(node_id: str) -> str:
    return f"{ACTOR_NAME_PREFIX}{node_id}"


@ray.remote(num_cpus=0)
class StateStoreActor:
    """One node's state store: owns the core `StateStore` and its gRPC server, for its lifetime.

    Binds `host:port` (port 0 picks a free port). Without a host it binds all interfaces and
    advertises the node's IP. The data path is gRPC (`address()`); this actor is only the
    control plane: address, stats, shutdown. Torch-free. `shutdown` stops the server and frees
    every stored byte (the disk tier's files too); call it before `ray.kill`.
    """

    def __init__(self, config: StoreConfig | None = None, host: str | None = None, port: int = 0) -> None:
        self._store = StateStore.from_config(config or StoreConfig())
        advertise = host or ray.util.get_node_ip_address()
        self._server: StateStoreServer | None = StateStoreServer(
            self._store, host or "0.0.0.0", port, advertise_host=advertise
        )
        self._address = self._server.address

    def address(self) -> str:
        """host:port of the StateStore gRPC service."""
        return self._address

    def stats(self) -> dict[str, Any]:
        """The store's `StoreStats`, as a plain dict (tiers as a list of dicts)."""
        return dataclasses.asdict(self._store.stats())

    def shutdown(self) -> None:
        """Stops serving and frees everything. Idempotent."""
        if self._server is not None:
            self._server.stop()
            self._server = None
            self._store.close()


def get_or_create_store_actor(
    config: StoreConfig | None = None,
    *,
    host: str | None = None,
    port: int = 0,
    node_id: str | None = None,
    namespace: str | None = None,
    detached: bool = False,
) -> tuple[ray.actor.ActorHandle, str]:
    """The store actor of `node_id` (default: the caller's node) and its gRPC address.

    Named `splitserve-store-<node_id>` and pinned to that node, so every caller on a node shares
    one store; the first call creates it with `config`, later calls get it (their config is
    ignored). `detached` keeps it alive after the creating job ends.
    """
    node_id = node_id or ray.get_runtime_context().get_node_id()
    options: dict[str, Any] = {
        "name": store_actor_name(node_id),
        "get_if_exists": True,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
    }
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    handle = StateStoreActor.options(**options).remote(config, host, port)  # type: ignore[attr-defined]
    return handle, ray.get(handle.address.remote())
