"""`apply` with fake actors: what each config change does to the pools, in which order, what it
refuses before anything changes, and what `status()` says while it works. (That a converge fails
no request under load is tests/deploy/test_apply_under_load.py's, with real actors.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from deploy.launcher import ClusterHandle, run_cluster
from tests.deploy.fakes import FAKE_CLASSES, HeldPrefill
from tests.deploy.helpers import small_config, wait_until

pytestmark = pytest.mark.usefixtures("ray_cluster")
CLASSES = {**FAKE_CLASSES, "prefill": HeldPrefill}


@pytest.fixture
def cluster(registry: Any) -> Iterator[ClusterHandle]:
    with run_cluster(small_config(), actor_classes=CLASSES) as handle:
        yield handle


def events(registry: Any) -> list[tuple[Any, ...]]:
    return ray.get(registry.get_events.remote())  # type: ignore[no-any-return]


def addresses(cluster: ClusterHandle, pool: str) -> list[str]:
    return [w["address"] for w in cluster.status()["pools"][pool]["workers"]]


def test_a_changed_engine_setting_rolls_the_pool_new_replica_serving_before_the_old_one_drains(
    cluster, registry
):
    # 0.25-CPU prefill replicas leave the 2-CPU cluster room for one more beside them
    cluster.apply(small_config(prefill={"replicas": 2, "num_cpus": 0.25}))
    old = addresses(cluster, "prefill")
    before = len(events(registry))
    result = cluster.apply(
        small_config(prefill={"replicas": 2, "num_cpus": 0.25, "max_num_batched_tokens": 1024})
    )
    assert result["plan"] == [
        "prefill: roll 2 replica(s), one at a time: start one of the new spec, then drain one of the old "
        "(max_num_batched_tokens: 2048 -> 1024)"
    ]
    log = events(registry)[before:]
    new = addresses(cluster, "prefill")
    assert len(new) == 2 and not set(new) & set(old)
    for old_address, new_address in zip(old, new):
        started = next(i for i, e in enumerate(log) if e[:3] == ("start", "prefill", new_address))
        both = next(
            i
            for i, e in enumerate(log)
            if e[0] == "update_workers" and {old_address, new_address} <= set(e[1])
        )
        gone = next(
            i for i, e in enumerate(log) if e[0] == "update_workers" and i > both and old_address not in e[1]
        )
        stopped = log.index(("shutdown", "prefill", old_address, small_config().health.drain_timeout_s))
        # the new one starts, the gateway routes to both, then stops routing to the old, which then drains
        assert started < both < gone < stopped
    constructed = [e[3] for e in log if e[:2] == ("construct", "prefill")]
    assert [c.max_num_batched_tokens for c in constructed] == [1024, 1024]
    status = cluster.status()
    assert status["healthy"] and status["pools"]["prefill"]["num_outdated"] == 0
    assert status["apply"]["done"] == [f"prefill: replace replica {i}" for i in (1, 2)]
    # one bundle beside the pool was enough: the second replacement took the bundle the first old one left
    live = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    assert sorted(len(g["bundles"]) for g in live) == [1, 1, 1]


def test_without_room_for_one_more_a_replica_is_replaced_in_its_own_bundle_while_the_other_serves(
    cluster, registry
):
    cluster.apply(small_config(prefill={"replicas": 2}))  # the 2 CPUs are all taken now
    old = addresses(cluster, "prefill")
    before = len(events(registry))
    cluster.apply(small_config(prefill={"replicas": 2, "max_num_seqs": 32}))
    log = events(registry)[before:]
    new = addresses(cluster, "prefill")
    for old_address, new_address in zip(old, new):
        stopped = log.index(("shutdown", "prefill", old_address, small_config().health.drain_timeout_s))
        started = next(i for i, e in enumerate(log) if e[:3] == ("start", "prefill", new_address))
        assert stopped < started
    assert all(e[1] for e in log if e[0] == "update_workers")  # the gateway always had a prefill worker


def test_a_pools_only_replica_is_replaced_only_beside_itself(registry):
    with run_cluster(small_config(prefill={"num_cpus": 1}), actor_classes=CLASSES) as cluster:  # 2 CPUs taken
        before = len(events(registry))
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            cluster.apply(small_config(prefill={"num_cpus": 1, "max_num_seqs": 8}))
        assert (
            "pool 'prefill' has one replica, which keeps serving only if its successor starts beside it"
            in str(info.value.cause)
        )
        assert events(registry)[before:] == [] and cluster.status()["pools"]["prefill"]["num_outdated"] == 0


def test_adding_and_removing_replicas_drains_the_removed_one_after_the_gateway_drops_it(cluster, registry):
    result = cluster.apply(small_config(decode={"replicas": 2}))
    assert result["plan"] == ["decode: add 1 replica(s) (1 -> 2)"]
    decode = addresses(cluster, "decode")
    assert len(decode) == 2 and result["status"]["pools"]["decode"]["addresses"] == decode
    before = len(events(registry))
    result = cluster.apply(small_config())
    assert result["plan"] == ["decode: drain and remove 1 replica(s) (2 -> 1), outdated ones first"]
    log = events(registry)[before:]
    gone = next(i for i, e in enumerate(log) if e[0] == "update_workers" and e[2] == decode[:1])
    assert gone < log.index(("shutdown", "decode", decode[1], small_config().health.drain_timeout_s))
    assert addresses(cluster, "decode") == decode[:1]


def test_a_model_change_is_refused_with_the_reason_and_nothing_changes(cluster, registry):
    before, status = len(events(registry)), cluster.status()
    changed = small_config(model={"path": "/models/another"}, decode={"replicas": 2}, store={"lease_s": 5})
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        cluster.apply(changed)
    message = str(info.value.cause)
    assert "nothing was changed" in message
    assert (
        "model cannot change live (model.path: '/models/not-loaded-by-fakes' -> '/models/another')" in message
    )
    assert "every worker and the gateway serve it" in message
    assert "store cannot change live (store.lease_s: 600 -> 5)" in message
    assert events(registry)[before:] == []
    after = cluster.status()
    assert after["pools"] == status["pools"] and after["apply"] == status["apply"]


def test_gateway_settings_and_the_mode_are_refused_health_changes_at_once(cluster, registry):
    for config, reason in [
        (small_config(router={"policy": "round_robin"}), "router_policy: 'prefix_aware' -> 'round_robin'"),
        (small_config(gateway={"api_keys": ["new-secret"]}), "gateway.api_keys: changed"),
        (small_config(mode="colocated", decode=None), "mode cannot change live (disaggregated -> colocated)"),
    ]:
        with pytest.raises(ray.exceptions.RayTaskError, match="nothing was changed") as info:
            cluster.apply(config)
        assert reason in str(info.value.cause) and "new-secret" not in str(info.value.cause)
    result = cluster.apply(small_config(health={"max_restarts": 7, "drain_timeout_s": 5}))
    assert result["plan"] == [
        "health.max_restarts: 2 -> 7 (at once)",
        "health.drain_timeout_s: 30 -> 5 (at once)",
    ]
    before = len(events(registry))
    cluster.apply(small_config(health={"max_restarts": 7, "drain_timeout_s": 5}, decode={"replicas": 2}))
    cluster.apply(small_config(health={"max_restarts": 7, "drain_timeout_s": 5}))
    assert [e for e in events(registry)[before:] if e[0] == "shutdown"][0][3] == 5  # the new drain timeout


def test_a_dry_run_says_what_would_change_and_changes_nothing(cluster, registry):
    before = len(events(registry))
    result = cluster.apply(small_config(prefill={"replicas": 2}), dry_run=True)
    assert result["plan"] == ["prefill: add 1 replica(s) (1 -> 2)"]
    assert events(registry)[before:] == [] and cluster.status()["pools"]["prefill"]["desired_replicas"] == 1


def test_status_shows_desired_and_actual_and_the_step_in_progress(cluster, registry):
    ray.get(registry.hold_starts.remote(True))
    outcome: dict[str, Any] = {}
    apply = threading.Thread(
        target=lambda: outcome.update(result=cluster.apply(small_config(prefill={"replicas": 2}))),
        daemon=True,
    )
    apply.start()
    try:
        status = wait_until(
            lambda: (s := cluster.status())["apply"]["in_progress"] and s["apply"]["step"] and s,
            what="the apply's first step",
        )
        pool = status["pools"]["prefill"]
        assert (pool["desired_replicas"], pool["num_healthy"]) == (2, 1)
        assert status["apply"]["step"] == "prefill: add 1 replica(s)"
        assert status["apply"]["plan"] == ["prefill: add 1 replica(s) (1 -> 2)"]
        with pytest.raises(ray.exceptions.RayTaskError, match="another apply is in progress"):
            cluster.apply(small_config(decode={"replicas": 2}))
    finally:
        ray.get(registry.hold_starts.remote(False))
        apply.join(60)
    assert not apply.is_alive()
    status = outcome["result"]["status"]
    assert status["pools"]["prefill"]["num_healthy"] == 2 and not status["apply"]["in_progress"]
    assert status["apply"]["done"] == ["prefill: add 1 replica(s)"] and status["apply"]["error"] is None


def test_a_replacement_that_fails_to_start_leaves_the_old_replica_serving_and_says_why(cluster, registry):
    old = addresses(cluster, "prefill")
    with pytest.raises(ray.exceptions.RayTaskError, match="this engine config cannot start"):
        cluster.apply(small_config(prefill={"max_num_seqs": 13}))
    status = cluster.status()
    assert status["healthy"] and addresses(cluster, "prefill") == old
    assert status["pools"]["prefill"]["num_outdated"] == 1
    assert status["apply"]["error"].startswith("prefill: replace replica 0: StartError: prefill 1 failed")
    assert not status["apply"]["in_progress"] and status["apply"]["step"] is None
    assert ("shutdown", "prefill", old[0], small_config().health.drain_timeout_s) not in events(registry)
    cluster.apply(small_config())  # back to the spec the replica runs: nothing to do
    assert cluster.status()["pools"]["prefill"]["num_outdated"] == 0 and addresses(cluster, "prefill") == old


def test_the_prefill_pool_can_be_removed_and_added_back_under_decode_local(cluster, registry):
    prefill = addresses(cluster, "prefill")
    result = cluster.apply(small_config(prefill={"replicas": 0}))
    assert result["plan"] == ["prefill: drain and remove 1 replica(s) (1 -> 0): the pool goes"]
    status = result["status"]
    assert status["pools"]["prefill"]["replicas"] == 0 and status["healthy"]
    assert events(registry)[-1] == ("shutdown", "prefill", prefill[0], small_config().health.drain_timeout_s)
    assert ("update_workers", [], addresses(cluster, "decode")) in events(registry)
    assert cluster.resize("prefill", 1)["pools"]["prefill"]["num_healthy"] == 1
