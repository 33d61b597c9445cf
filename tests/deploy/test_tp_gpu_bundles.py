"""A tensor-parallel pool on GPUs, on a local Ray that counts 4 logical GPUs (Ray assigns them as it
would real ones; no engine runs here): the controller reserves one GPU bundle per rank and hands the
worker the bundles of its other ranks, and rank actors started in those bundles are each shown a GPU
of their own and run on `cuda:0`. A rank actor's command port lets in only its driver's key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from deploy.launcher import required_resources, run_cluster
from splitserve.engine.parallel.actor_ranks import RankActors
from splitserve.engine_config import EngineConfig
from splitserve.rank_placement import RankPlacement
from tests.deploy.fakes import FAKE_CLASSES
from tests.deploy.helpers import small_config

NUM_GPUS = 4


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """This module's own local Ray, with logical GPUs (the `registry` fixture runs on it)."""
    ray.init(num_cpus=4, num_gpus=NUM_GPUS, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_a_pool_at_tensor_parallel_2_with_one_gpu_per_rank_reserves_two_gpu_bundles(registry: Any):
    config = small_config(decode={"num_cpus": 0.25, "num_gpus": 1, "tensor_parallel": 2, "replicas": 2})
    assert required_resources(config)["GPU"] == 4  # 2 replicas x 2 ranks x 1 GPU
    with run_cluster(config, actor_classes=FAKE_CLASSES) as handle:
        assert handle.status()["pools"]["decode"]["tensor_parallel"] == 2
        groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        (decode_group,) = [g for g in groups if any("GPU" in b for b in g["bundles"].values())]
        assert list(decode_group["bundles"].values()) == [{"CPU": 0.25, "GPU": 1.0}] * 4
        assert len(set(decode_group["bundles_to_node_id"].values())) == 1
        events = ray.get(registry.get_events.remote())
        placements = [e[5] for e in events if e[:2] == ("construct", "decode")]
        # each replica's worker sits in its first bundle and is handed the next for its rank 1
        assert sorted(p.worker_bundle_index for p in placements) == [0, 2]
        assert sorted(p.bundle_index(1) for p in placements) == [1, 3]
        assert all(
            (p.group.id.hex(), p.num_gpus) == (decode_group["placement_group_id"], 1.0) for p in placements
        )
        # a CPU pool's worker is given none
        assert [e[5] for e in events if e[:2] == ("construct", "prefill")] == [None]


def test_rank_actors_in_gpu_bundles_each_see_a_gpu_of_their_own():
    group = placement_group([{"CPU": 0.1, "GPU": 1}] * 3, strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    launcher = RankActors(RankPlacement(group, worker_bundle_index=0, num_cpus=0.1, num_gpus=1))
    handles, conns = launcher.start(world_size=3)
    try:
        where = [h.where() for h in handles]
        assert [w["bundle_index"] for w in where] == [1, 2]
        assert {w["placement_group_id"] for w in where} == {group.id.hex()}
        gpus = [w["gpu_ids"] for w in where]
        assert all(len(ids) == 1 for ids in gpus) and gpus[0] != gpus[1], gpus
        assert [h.ended() for h in handles] == [None, None]  # alive and serving
        config = EngineConfig(model="m", device="cuda", tensor_parallel_size=3)
        assert {launcher.rank_config(config, rank).device for rank in range(3)} == {"cuda:0"}
    finally:
        for conn in conns:
            conn.close()
        for handle in handles:
            handle.kill()
        remove_placement_group(group)


def test_a_rank_actor_drops_a_caller_without_the_drivers_key_and_still_takes_the_driver():
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from splitserve.engine.parallel.actor_ranks import RankActor

    actor = ray.remote(RankActor).options(num_cpus=0.1).remote(b"the driver's key")
    try:
        address = tuple(ray.get(actor.listen.remote(), timeout=60)["address"])
        serving = actor.serve.remote()
        with pytest.raises(AuthenticationError):
            Client(address, authkey=b"a guess")
        with Client(address, authkey=b"the driver's key"):  # refused, were the listener gone
            assert ray.wait([serving], timeout=0)[0] == []  # serving the driver: it waits for its setup
    finally:
        ray.kill(actor, no_restart=True)
