"""The controller: placement, start order, status, restarts, resize, stop.

Most tests run it on fake actors (tests/deploy/fakes.py: no model, no engine, no store; each
records what the controller did to it), so they check the controller's bookkeeping, not the
workers'. The last tests start the real store and workers (`test_real_...`, the gateway still
fake) and a fully real deployment. A real deployment resized under traffic:
tests/faults/test_churn.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from deploy.controller import PlacementError
from deploy.launcher import ClusterError, ClusterHandle, run_cluster
from tests.deploy.fakes import FAKE_CLASSES, FailingPrefill
from tests.deploy.helpers import check_status_shape, is_dead, is_dead_controller, small_config, wait_until

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture
def cluster(registry: Any) -> Iterator[ClusterHandle]:
    handle = run_cluster(small_config(), actor_classes=FAKE_CLASSES)
    yield handle
    handle.stop()


def events(registry: Any, kind: str | None = None) -> list[tuple[Any, ...]]:
    return [e for e in ray.get(registry.get_events.remote()) if kind is None or e[0] == kind]


def live_groups() -> list[dict[str, Any]]:
    return [g for g in placement_group_table().values() if g["state"] != "REMOVED"]


def test_start_places_pools_and_starts_store_then_workers_then_gateway(cluster, registry):
    starts = [e[1] for e in events(registry, "start")]
    assert starts[0] == "store"
    assert sorted(starts[1:3]) == ["decode", "prefill"]
    assert starts[3] == "gateway"
    status = cluster.status()
    store_address = status["stores"][0]["address"]
    constructed = {e[1]: e for e in events(registry, "construct")}
    assert constructed["prefill"][2] == store_address and constructed["decode"][2] == store_address
    model_path = small_config().model.resolved_path()
    for pool in ("prefill", "decode"):  # each worker gets its own pool's engine config
        assert constructed[pool][3] == small_config().engine_config(pool, model_path=model_path)
    groups = live_groups()
    assert sorted(g["bundles"][0]["CPU"] for g in groups) == [0.5, 0.5]
    assert all(g["strategy"] == "PACK" for g in groups)
    prefill, decode = status["pools"]["prefill"], status["pools"]["decode"]
    assert events(registry, "update_workers")[-1] == (
        "update_workers",
        prefill["addresses"],
        decode["addresses"],
    )


def test_status_reports_replicas_addresses_health_restarts_and_load(cluster):
    status = cluster.status()
    assert status["healthy"] and status["mode"] == "disaggregated" and status["model"] == "fake-model"
    for name in ("prefill", "decode"):
        pool = status["pools"][name]
        assert pool["replicas"] == 1 and pool["num_healthy"] == 1 and pool["healthy"]
        assert pool["restarts"] == 0
        assert len(pool["addresses"]) == 1 and pool["addresses"][0].count(":") == 1
        assert pool["load"] == {"num_running": 1}
        assert pool["bundle"] == {"CPU": 0.5}
    assert status["gateway"]["healthy"] and status["gateway"]["url"].startswith("http://127.0.0.1:")
    assert len(status["stores"]) == 1 and status["stores"][0]["healthy"]


def test_a_killed_worker_is_restarted_and_the_gateway_hears_its_new_address(cluster, registry):
    old_address = kill_worker(cluster, registry, "decode")

    def restarted() -> dict[str, Any] | None:
        pool = cluster.status()["pools"]["decode"]
        return pool if pool["restarts"] == 1 and pool["healthy"] else None

    pool = wait_until(restarted, what="the decode worker to restart")
    new_address = pool["addresses"][0]
    assert new_address != old_address
    prefill = cluster.status()["pools"]["prefill"]["addresses"]
    wait_until(
        lambda: events(registry, "update_workers")[-1] == ("update_workers", prefill, [new_address]),
        what="update_workers with the new address",
    )
    assert cluster.status()["healthy"]


def test_two_gateway_processes_start_after_their_ledger_on_one_port_and_a_killed_one_comes_back(registry):
    with run_cluster(small_config(gateway={"replicas": 2}), actor_classes=FAKE_CLASSES) as cluster:
        status = cluster.status()
        check_status_shape(status)
        first, second = status["gateways"]
        assert (first["index"], second["index"]) == (0, 1) and first["healthy"] and second["healthy"]
        assert first["address"] == second["address"]  # the second joined the port the first bound
        assert status["ledger"]["kind"] == "ledger" and status["ledger"]["healthy"]
        assert [e[1]["num_gateways"] for e in events(registry, "gateway_settings")] == [2, 2]
        assert [e[1] for e in events(registry, "use_ledger")] == [0, 1]  # each before it started
        workers = (status["pools"]["prefill"]["addresses"], status["pools"]["decode"]["addresses"])
        assert events(registry, "update_workers") == [("update_workers", *workers)] * 2
        handles = [h for kind, _, h in ray.get(registry.get_handles.remote()) if kind == "gateway"]
        ray.kill(handles[1])
        wait_until(
            lambda: (g := cluster.status()["gateways"][1])["restarts"] == 1 and g["healthy"],
            what="gateway 1 to restart",
        )
        assert cluster.status()["gateways"][1]["address"] == first["address"]  # on the same port
        assert [e[1] for e in events(registry, "use_ledger")] == [0, 1, 1]
        wait_until(lambda: len(events(registry, "update_workers")) == 3, what="the new gateway 1 to hear")
        assert events(registry, "update_workers")[-1] == ("update_workers", *workers)
        assert cluster.status()["published"] == {"prefill": workers[0], "decode": workers[1]}


def kill_worker(cluster: ClusterHandle, registry: Any, pool: str) -> str:
    """Kill the pool's first worker; return the address it had."""
    address = cluster.status()["pools"][pool]["workers"][0]["address"]
    handle = next(h for _, a, h in ray.get(registry.get_handles.remote()) if a == address)
    ray.kill(handle)
    return address


def first_worker(cluster: ClusterHandle, pool: str) -> dict[str, Any]:
    return cluster.status()["pools"][pool]["workers"][0]


def test_a_worker_that_keeps_dying_is_given_up_after_max_restarts(registry):
    with run_cluster(small_config(health={"max_restarts": 1}), actor_classes=FAKE_CLASSES) as cluster:
        old = kill_worker(cluster, registry, "prefill")
        wait_until(
            lambda: (w := first_worker(cluster, "prefill"))["healthy"] and w["address"] != old,
            what="the first restart",
        )
        kill_worker(cluster, registry, "prefill")
        worker = wait_until(
            lambda: (w := first_worker(cluster, "prefill"))["given_up"] and w, what="the give-up"
        )
        assert worker["restarts"] == 1 and not worker["healthy"]
        assert "gave up after 1 restarts" in worker["error"]
        assert not cluster.status()["healthy"]
        wait_until(lambda: events(registry, "update_workers")[-1][1] == [], what="the gateway to drop it")


def test_restarts_older_than_the_window_no_longer_count(registry):
    # a health pass takes 0.2 s, so the first restart is always older than 0.01 s at the second death
    config = small_config(health={"max_restarts": 1, "restart_window_s": 0.01})
    with run_cluster(config, actor_classes=FAKE_CLASSES) as cluster:
        for restart in (1, 2):
            old = kill_worker(cluster, registry, "prefill")
            worker = wait_until(
                lambda old=old: (
                    (w := first_worker(cluster, "prefill"))["healthy"] and w["address"] != old and w
                ),
                what=f"restart {restart}",
            )
            assert worker["restarts"] == restart and not worker["given_up"]


def test_resize_of_fake_workers_reserves_a_group_up_and_down_tells_the_gateway_before_stopping(
    cluster, registry
):
    """Fake workers: the controller's side of a resize and in which order (a placement group per
    replica, the gateway told the new addresses, the removed actor shut down with the drain
    timeout, the refusals). The fakes hold no requests: that real workers serve through a resize
    is tests/faults/test_churn.py's and tests/deploy/test_apply_under_load.py's to show."""
    status = cluster.resize("prefill", 2)
    pool = status["pools"]["prefill"]
    assert pool["replicas"] == 2 and pool["num_healthy"] == 2 and len(set(pool["addresses"])) == 2
    assert len(live_groups()) == 3
    decode = status["pools"]["decode"]["addresses"]
    assert events(registry, "update_workers")[-1] == ("update_workers", pool["addresses"], decode)
    removed_address = pool["addresses"][1]
    removed = next(h for _, a, h in ray.get(registry.get_handles.remote()) if a == removed_address)

    before = len(events(registry))
    status = cluster.resize("prefill", 1)
    assert status["pools"]["prefill"]["addresses"] == pool["addresses"][:1]
    log = events(registry)[before:]
    told = log.index(("update_workers", pool["addresses"][:1], decode))
    stopped = log.index(("shutdown", "prefill", removed_address, small_config().health.drain_timeout_s))
    assert told < stopped  # the gateway stopped routing to it before it was asked to drain and stop
    assert is_dead(removed)
    assert len(live_groups()) == 2
    with pytest.raises(ray.exceptions.RayTaskError, match="decode.replicas: must be at least 1"):
        cluster.resize("decode", 0)
    with pytest.raises(ray.exceptions.RayTaskError, match="no pool 'colocated'"):
        cluster.resize("colocated", 2)


def test_stop_ends_every_actor_the_controller_and_placement_group(registry):
    cluster = run_cluster(small_config(), actor_classes=FAKE_CLASSES)
    handles = [h for _, _, h in ray.get(registry.get_handles.remote())]
    assert len(handles) == 4  # store, prefill, decode, gateway
    cluster.stop()
    assert all(is_dead(h) for h in handles)
    assert is_dead_controller()
    assert live_groups() == []
    assert {e[1] for e in events(registry, "shutdown")} == {"store", "prefill", "decode", "gateway"}
    assert ray.is_initialized()  # the test started Ray, so stop() leaves it running


def test_colocated_mode_starts_colocated_workers_for_both_phases(registry):
    config = small_config(mode="colocated", decode=None, prefill={"replicas": 2})
    with run_cluster(config, actor_classes=FAKE_CLASSES) as cluster:
        status = cluster.status()
        assert list(status["pools"]) == ["prefill"] and status["pools"]["prefill"]["role"] == "colocated"
        addresses = status["pools"]["prefill"]["addresses"]
        assert len(addresses) == 2
        assert sorted(e[1] for e in events(registry, "start")) == [
            "colocated",
            "colocated",
            "gateway",
            "store",
        ]
        assert events(registry, "update_workers")[-1] == ("update_workers", addresses, addresses)


def test_a_bundle_no_node_can_hold_fails_at_once_naming_the_pool_and_leaves_nothing(registry):
    # start_timeout_s stays 30: a placement wait would end in "could not reserve ... within 30 s".
    config = small_config(prefill={"num_cpus": 8})
    with pytest.raises(
        ClusterError, match=r"pool 'prefill': cannot reserve 1 x \{'CPU': 8.0\} \(PACK\): no node"
    ):
        run_cluster(config, actor_classes=FAKE_CLASSES)
    assert is_dead_controller()
    assert live_groups() == []
    assert events(registry, "start") == []


def test_a_custom_resource_no_node_has_fails_at_once_naming_the_pool(registry):
    config = small_config(decode={"resources": {"decode_host": 1}})  # this Ray has no node with it
    message = (
        r"pool 'decode': cannot reserve 1 x \{'CPU': 0.5, 'decode_host': 1.0\} \(PACK\): no node has "
        r"room for one \(the largest have CPU 2, decode_host 0\)"
    )
    with pytest.raises(ClusterError, match=message):
        run_cluster(config, actor_classes=FAKE_CLASSES)
    assert is_dead_controller() and live_groups() == []


def test_pools_that_together_exceed_the_cluster_fail_at_once_naming_the_pool_that_does_not_fit(registry):
    config = small_config(prefill={"replicas": 3})  # 3 x 0.5 + 0.5 + store 0.25 + gateway 0.25 CPUs > 2
    message = (
        r"pool 'decode': cannot reserve 1 x \{'CPU': 0.5\} \(PACK\): they need CPU 0.5, and the Ray "
        r"cluster has CPU 2 in all, of which the rest of this deployment takes 2 "
    )
    with pytest.raises(ClusterError, match=message):
        run_cluster(config, actor_classes=FAKE_CLASSES)
    assert is_dead_controller() and live_groups() == []


def test_strict_spread_over_more_replicas_than_nodes_fails_at_once(registry):
    config = small_config(prefill={"replicas": 2, "placement": "STRICT_SPREAD"})
    with pytest.raises(
        ClusterError, match="STRICT_SPREAD needs 2 nodes with room for one each; the cluster has 1"
    ):
        run_cluster(config, actor_classes=FAKE_CLASSES)
    assert is_dead_controller() and live_groups() == []


def test_resources_held_by_others_are_waited_for_then_the_placement_times_out_naming_the_pool(registry):
    hog = placement_group([{"CPU": 2}])  # not this deployment's: it might be freed, so start waits
    ray.get(hog.ready(), timeout=30)
    try:
        config = small_config(health={"start_timeout_s": 1})
        message = (
            r"pool 'prefill': could not reserve 1 x \{'CPU': 0.5\} \(PACK\) within 1 s; "
            r"the Ray cluster has CPU 2 in all, 0 free"
        )
        with pytest.raises(ClusterError, match=message):
            run_cluster(config, actor_classes=FAKE_CLASSES)
    finally:
        remove_placement_group(hog)
    assert is_dead_controller()
    assert live_groups() == []


def test_resize_of_fake_workers_beyond_the_cluster_fails_at_once_and_changes_nothing(cluster, registry):
    """Fake workers taking the real bundles: the refusal is the controller's placement check,
    made before any actor starts, so no worker (fake or real) is touched."""
    # 1.5 of the 2 CPUs are taken (prefill, decode 0.5 each, store, gateway 0.25 each).
    message = (
        r"pool 'prefill': cannot reserve 2 x \{'CPU': 0.5\} \(PACK\): they need CPU 1, and the Ray "
        r"cluster has CPU 2 in all, of which the rest of this deployment takes 1.5 \(free now: 0.5\)"
    )
    with pytest.raises(PlacementError, match=message):
        cluster.resize("prefill", 3)
    status = cluster.status()
    assert status["healthy"] and status["pools"]["prefill"]["replicas"] == 1
    assert len(live_groups()) == 2
    assert [e[1] for e in events(registry, "start")].count("prefill") == 1


def test_a_tensor_parallel_pool_reserves_a_bundle_per_rank(registry):
    config = small_config(prefill={"num_cpus": 0.25, "tensor_parallel": 2})
    with run_cluster(config, actor_classes=FAKE_CLASSES) as handle:
        assert sorted(len(g["bundles"]) for g in live_groups()) == [1, 2]  # decode's, prefill's 2 ranks
        assert handle.status()["pools"]["prefill"]["tensor_parallel"] == 2
        # gateway, store 0.25 each, prefill 2 x 0.25, decode 0.5: two more replicas need 4 bundles
        message = (
            r"pool 'prefill': cannot reserve 2 \(2 ranks each\) x \{'CPU': 0.25\} \(PACK\): they need "
            r"CPU 1, and the Ray cluster has CPU 2 in all, of which the rest of this deployment takes 1.5"
        )
        with pytest.raises(PlacementError, match=message):
            handle.resize("prefill", 3)
        handle.resize("prefill", 2)  # one more fits: its own group of 2 bundles
        assert sorted(len(g["bundles"]) for g in live_groups()) == [1, 2, 2]
        assert handle.status()["pools"]["prefill"]["replicas"] == 2


def test_a_second_deployment_in_the_same_ray_cluster_is_refused(cluster):
    with pytest.raises(ClusterError, match="already running"):
        run_cluster(small_config(), actor_classes=FAKE_CLASSES)


def test_real_store_and_workers_start_report_load_and_restart(registry):
    """The actual StateStoreActor and worker actors on the tiny model (only the gateway is fake)."""
    config = small_config(
        model={"path": None, "name": None},
        prefill={"kv_cache_memory_bytes": "16MiB"},
        decode={"kv_cache_memory_bytes": "16MiB"},
        store={"memory_bytes": "64MiB", "disk": {"path": None}},
        health={"interval_s": 0.5, "timeout_s": 30, "start_timeout_s": 300},
    )
    fakes = {"gateway": FAKE_CLASSES["gateway"], "gateway_settings": FAKE_CLASSES["gateway_settings"]}
    with run_cluster(config, actor_classes=fakes) as cluster:
        status = wait_until(
            lambda: (s := cluster.status())["pools"]["decode"]["load"].get("num_total_kv_blocks") and s,
            what="the first stats",
        )
        assert status["healthy"] and status["model"] == "tiny-kimi-linear"
        assert status["pools"]["prefill"]["load"]["num_running"] == 0
        check_status_shape(status)
        assert is_idle(status)
        (store,) = status["stores"]
        assert store["node_id"] == ray.get_runtime_context().get_node_id()
        assert [(t["name"], t["num_bytes"], t["capacity_bytes"]) for t in store["stats"]["tiers"]] == [
            ("memory", 0, 64 << 20)
        ]
        prefill, decode = status["pools"]["prefill"]["addresses"], status["pools"]["decode"]["addresses"]
        assert events(registry, "update_workers")[-1] == ("update_workers", prefill, decode)

        pool = kill_decode_worker_and_wait_for_its_restart(cluster)
        assert pool["addresses"] != decode
        wait_until(
            lambda: events(registry, "update_workers")[-1] == ("update_workers", prefill, pool["addresses"]),
            what="the gateway to hear the new decode address",
        )


def test_a_worker_that_fails_to_start_fails_the_launch_naming_it_and_leaves_nothing(registry):
    with pytest.raises(ClusterError, match=r"prefill 0 failed to start: FileNotFoundError: /models/missing"):
        run_cluster(small_config(), actor_classes={**FAKE_CLASSES, "prefill": FailingPrefill})
    assert is_dead_controller() and live_groups() == []
    handles = [h for _, _, h in ray.get(registry.get_handles.remote())]
    assert handles and all(is_dead(h) for h in handles)


def kill_decode_worker_and_wait_for_its_restart(cluster: Any) -> dict[str, Any]:
    """Kills decode replica 0; returns the decode pool's status once its one restart is healthy."""
    ray.kill(ray.get(cluster.controller.worker_handle.remote("decode", 0)))
    return wait_until(  # type: ignore[no-any-return]
        lambda: (p := cluster.status()["pools"]["decode"])["restarts"] == 1 and p["healthy"] and p,
        what="the decode worker to restart",
        timeout_s=180,
    )


def is_idle(status: dict[str, Any]) -> bool:
    """Every worker holds no request and has all its KV blocks and state slots free; no store
    holds a key (what status() reports as of the last health pass)."""
    workers = [w["stats"] for pool in status["pools"].values() for w in pool["workers"]]
    return all(
        (w["num_running"], w["num_waiting"], w["num_reserved"]) == (0, 0, 0)
        and w["num_free_kv_blocks"] == w["num_total_kv_blocks"] > 0
        and w["num_free_state_slots"] == w["num_total_state_slots"] > 0
        for w in workers
    ) and all(store["stats"]["num_keys"] == 0 for store in status["stores"])


def completion(url: str) -> str:
    import httpx

    body = {"model": "tiny-kimi-linear", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_the_real_deployment_serves_a_completion_before_and_after_a_decode_restart():
    """Every actor real (the gateway too): a killed decode worker is replaced and serving resumes."""
    config = small_config(
        model={"path": None, "name": None},
        prefill={"kv_cache_memory_bytes": "16MiB"},
        decode={"kv_cache_memory_bytes": "16MiB"},
        store={"memory_bytes": "64MiB", "disk": {"path": None}},
        health={"interval_s": 0.5, "timeout_s": 30, "start_timeout_s": 300},
    )
    with run_cluster(config) as cluster:
        url = cluster.gateway_url
        assert url is not None
        first = completion(url)
        status = wait_until(lambda: is_idle(s := cluster.status()) and s, what="idle workers, empty store")
        check_status_shape(status)
        assert status["gateway"]["stats"]["ready"] and status["gateway"]["url"] == url
        old = status["pools"]["decode"]["addresses"]
        pool = kill_decode_worker_and_wait_for_its_restart(cluster)
        assert pool["addresses"] != old
        wait_until(
            lambda: cluster.status()["published"]["decode"] == pool["addresses"],
            what="the gateway to hear of the new worker",
        )
        assert completion(url) == first  # the old worker is dead: the new one answers, greedily the same
