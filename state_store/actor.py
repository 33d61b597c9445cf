"""The per-node store as a Ray actor: `StateStoreActor`, and get-or-create for the current node."""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore

ACTOR_NAME_PREFIX = "splitserve-store-"


def store_actor_name(node_id: str) -> str:
    return f"{ACTOR_NAME_PREFIX}{node_id}"


class StateStoreActor:
    """One node's state store: owns the core `StateStore` and, once started, its gRPC server.

    A plain class like the worker actors: the controller (or `get_or_create_store_actor`) applies
    `ray.remote(...)` with its resources, and tests may run it in-process. The data path is gRPC
    (`start` returns "host:port"); the actor is only the control plane: start, address, health,
    stats, shutdown. Torch-free. `shutdown` stops the server and frees every stored byte (the
    disk tier's files too); call it before `ray.kill`.
    """

    def __init__(
        self,
        memory_bytes: int = StoreConfig.memory_bytes,
        disk_path: str | None = None,
        disk_bytes: int = 0,
        lease_s: float = StoreConfig.default_lease_s,
        transfer_engine: str = StoreConfig.transfer_engine,
    ) -> None:
        if not disk_bytes:
            disk_path = None  # a disk tier of 0 bytes is no disk tier
        self.config = StoreConfig(memory_bytes, disk_path, disk_bytes, lease_s, transfer_engine=transfer_engine)
        self._store = StateStore.from_config(self.config)
        self._server: StateStoreServer | None = None

    def start(self, host: str | None = None, port: int = 0) -> str:
        """Serves on host:port (port 0 = any free one); returns the address to give clients.

        Without a host it binds the node's own IP (Ray's), never every interface. Idempotent.
        """
        if self._server is None:
            host = host or ray.util.get_node_ip_address()
            self._server = StateStoreServer(self._store, host, port)
        return self._server.address

    def address(self) -> str | None:
        """host:port of the StateStore gRPC service, or None before `start`."""
        return self._server.address if self._server is not None else None

    def health(self) -> bool:
        return self._server is not None

    def stats(self) -> dict[str, Any]:
        """The store's `StoreStats` as a plain dict (tiers as a list of dicts), plus its address."""
        return {"role": "store", "address": self.address(), **dataclasses.asdict(self._store.stats())}

    def shutdown(self) -> None:
        """Stops serving and frees everything. Idempotent."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._store.close()

    def __ray_shutdown__(self) -> None:
        """Ray ends an actor whose handles are all dropped gracefully, without `shutdown`: free
        everything then too, or the disk tier's files and the arena's /dev/shm regions (RAM)
        outlive the process until another store starts on the node."""
        self.shutdown()


def get_or_create_store_actor(
    config: StoreConfig | None = None,
    *,
    host: str | None = None,
    port: int = 0,
    node_id: str | None = None,
    namespace: str | None = None,
    detached: bool = False,
    num_cpus: float = 0,
) -> tuple[ray.actor.ActorHandle, str]:
    """The store actor of `node_id` (default: the caller's node), started, and its gRPC address.

    Named `splitserve-store-<node_id>` and pinned to that node, so every caller on a node shares
    one store; the first call creates it with `config`, later calls get it (their config is
    ignored). `detached` keeps it alive after the creating job ends.
    """
    config = config or StoreConfig()
    node_id = node_id or ray.get_runtime_context().get_node_id()
    options: dict[str, Any] = {
        "name": store_actor_name(node_id),
        "get_if_exists": True,
        "num_cpus": num_cpus,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
    }
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    remote_class: Any = ray.remote(StateStoreActor)
    handle = remote_class.options(**options).remote(
        config.memory_bytes, config.disk_path, config.disk_bytes, config.default_lease_s, config.transfer_engine
    )
    return handle, ray.get(handle.start.remote(host, port))
