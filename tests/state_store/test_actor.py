"""One StateStoreActor per node: get-or-create by name, its gRPC address works, shutdown frees all,
and so does Ray ending the actor gracefully (its handles dropped) without a shutdown."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from splitserve.state.client import StateStoreClient
from splitserve.state.errors import StateUnavailableError
from state_store.actor import StateStoreActor, get_or_create_store_actor, store_actor_name
from state_store.config import StoreConfig
from tests.state_store.conftest import make_chunk


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_the_node_store_is_created_once_and_serves_grpc(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    disk = tmp_path_factory.mktemp("store-disk")
    config = StoreConfig(memory_bytes=1 << 20, disk_path=str(disk), disk_bytes=8 << 20)
    handle, address = get_or_create_store_actor(config, host="127.0.0.1")
    try:
        _, same_address = get_or_create_store_actor(StoreConfig(memory_bytes=1), host="127.0.0.1")
        assert same_address == address  # the second caller got the first actor, not a new one
        node_id = ray.get_runtime_context().get_node_id()
        assert ray.get_actor(store_actor_name(node_id)) is not None
        with StateStoreClient(address) as client:
            chunks = [make_chunk("req", layer, size=300_000) for layer in range(6)]  # spills past 1 MiB
            client.put(chunks, owner="prefill-0", seal=True)
            assert [c.data for c in client.get("req")] == [c.data for c in chunks]
        assert ray.get(handle.health.remote()) is True
        stats: dict[str, Any] = ray.get(handle.stats.remote())
        assert stats["address"] == address and stats["num_keys"] == 1 and stats["num_spills"] > 0
        assert sum(t["num_bytes"] for t in stats["tiers"]) == 6 * 300_000
        assert any(disk.iterdir())
    finally:
        ray.get(handle.shutdown.remote())
        ray.kill(handle)
    assert not any(disk.iterdir())  # shutdown deleted the disk tier's files
    with StateStoreClient(address, timeout_s=5.0) as client, pytest.raises(StateUnavailableError):
        client.stats()  # and stopped serving


def test_a_store_actor_ray_ends_gracefully_frees_its_disk_files(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    disk = tmp_path_factory.mktemp("dropped-store-disk")
    handle = ray.remote(StateStoreActor).options(num_cpus=0).remote(1 << 20, str(disk), 8 << 20, 5.0)
    address = ray.get(handle.start.remote("127.0.0.1", 0))
    with StateStoreClient(address) as client:
        client.put([make_chunk("req", layer, size=300_000) for layer in range(6)], owner="w", seal=True)
    assert any(disk.iterdir())  # spilled past 1 MiB of memory
    del handle  # no shutdown call: Ray ends the actor once its last handle is gone
    deadline = time.monotonic() + 60
    while any(disk.iterdir()):
        assert time.monotonic() < deadline, f"the ended store left {sorted(p.name for p in disk.iterdir())}"
        time.sleep(0.1)


def test_the_actor_class_runs_in_process_too(tmp_path_factory: pytest.TempPathFactory) -> None:
    actor = StateStoreActor(1 << 20, str(tmp_path_factory.mktemp("disk")), 0, 5.0)  # 0 disk bytes: no disk
    assert not actor.health() and actor.address() is None
    address = actor.start("127.0.0.1", 0)
    try:
        assert actor.health() and actor.start("127.0.0.1", 0) == address
        assert [t["name"] for t in actor.stats()["tiers"]] == ["memory"]
        with StateStoreClient(address) as client:
            client.put([make_chunk("req")], owner="w", seal=True)
            assert actor.stats()["num_keys"] == 1
    finally:
        actor.shutdown()
    assert not actor.health() and actor.stats()["num_keys"] == 0
