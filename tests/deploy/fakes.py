"""Test doubles for the actors the controller starts (passed through `actor_classes`).

Each fake records what happens to it in one named `Registry` actor, so a test can read the
start order, the addresses the gateway was told, and hold every fake's handle.
"""

from __future__ import annotations

import time
from typing import Any

import ray

REGISTRY_NAME = "fake-registry"
REGISTRY_NAMESPACE = "splitserve-tests"


@ray.remote(num_cpus=0)
class Registry:
    """Events in order, and the handle of every fake that started."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.handles: list[tuple[str, str, Any]] = []  # (kind, address, handle)
        self.port = 20000
        self.starts_held = False  # HeldWorker fakes wait in start() while this is set

    def hold_starts(self, held: bool) -> None:
        self.starts_held = held

    def are_starts_held(self) -> bool:
        return self.starts_held

    def record(self, *event: Any) -> None:
        self.events.append(event)

    def next_port(self) -> int:
        self.port += 1
        return self.port

    def register(self, kind: str, address: str, handle: Any, node_id: str) -> None:
        self.handles.append((kind, address, handle[0]))
        self.events.append(("start", kind, address, node_id))

    def get_events(self) -> list[tuple[Any, ...]]:
        return list(self.events)

    def get_handles(self) -> list[tuple[str, str, Any]]:
        return list(self.handles)


def _registry() -> Any:
    return ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE)


class _Fake:
    kind = "fake"

    def start(self, host: str, port: int = 0) -> str:
        registry = _registry()
        self.address = f"{host}:{port or ray.get(registry.next_port.remote())}"
        me = ray.get_runtime_context().current_actor
        node_id = ray.get_runtime_context().get_node_id()
        ray.get(registry.register.remote(self.kind, self.address, [me], node_id))
        return self.address

    def health(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {"num_running": 1, "kind": self.kind}

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        ray.get(_registry().record.remote("shutdown", self.kind, self.address, drain_timeout_s))


class FakeStore(_Fake):
    kind = "store"

    def __init__(self, memory_bytes: int, disk_path: str | None, disk_bytes: int, lease_s: float) -> None:
        assert isinstance(memory_bytes, int) and isinstance(disk_bytes, int)
        self.lease_s = lease_s


class _FakeWorker(_Fake):
    def __init__(self, engine_config: Any, store_address: str, rank_placement: Any = None) -> None:
        self.engine_config = engine_config
        node_id = ray.get_runtime_context().get_node_id()
        event = ("construct", self.kind, store_address, engine_config, node_id, rank_placement)
        ray.get(_registry().record.remote(*event))


class FakePrefill(_FakeWorker):
    kind = "prefill"


class FakeDecode(_FakeWorker):
    kind = "decode"


class FakeColocated(_FakeWorker):
    kind = "colocated"


class FakeSettings:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class FakeGateway(_Fake):
    kind = "gateway"

    def __init__(self, settings: FakeSettings) -> None:
        self.settings = settings
        ray.get(_registry().record.remote("gateway_settings", dict(settings.__dict__)))

    def use_ledger(self, ledger: Any, gateway_index: int) -> None:
        ray.get(_registry().record.remote("use_ledger", gateway_index, ray.get(ledger.health.remote())))

    def update_workers(
        self, prefill_addresses: list[str], decode_addresses: list[str], stores: dict[str, str] | None = None
    ) -> None:
        ray.get(_registry().record.remote("update_workers", list(prefill_addresses), list(decode_addresses)))


FAKE_CLASSES: dict[str, type] = {
    "store": FakeStore,
    "prefill": FakePrefill,
    "decode": FakeDecode,
    "colocated": FakeColocated,
    "gateway": FakeGateway,
    "gateway_settings": FakeSettings,
}


class FailingPrefill(FakePrefill):
    """A prefill worker whose `start()` fails, as one whose checkpoint is missing would."""

    def start(self, host: str, port: int = 0) -> str:
        raise FileNotFoundError("/models/missing/config.json")


class HeldPrefill(FakePrefill):
    """A prefill worker whose `start()` waits while the registry holds starts (a slow model load),
    and fails for an engine config of `max_num_seqs: 13` (a new spec that cannot start)."""

    def start(self, host: str, port: int = 0) -> str:
        while ray.get(_registry().are_starts_held.remote()):
            time.sleep(0.05)
        if self.engine_config.max_num_seqs == 13:
            raise RuntimeError("this engine config cannot start")
        return super().start(host, port)
