"""`apply` and `resize` on an autoscaled pool (the controller with fake actors): the planner owns
the count between the bounds, so an apply keeps it within the new bounds rather than resetting
it to the file's `replicas`, and a resize is refused with what to do instead."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from deploy.launcher import ClusterHandle, run_cluster
from tests.deploy.fakes import FAKE_CLASSES
from tests.deploy.helpers import small_config

pytestmark = pytest.mark.usefixtures("ray_cluster")
# the planner looks once at the start (the fake gateway reports no load: the pass fails) and
# not again during the test
SLOW = {"interval_s": 3600, "cooldown_s": 3600}


def autoscaled(**autoscale: Any) -> dict[str, Any]:
    return {"decode": {"replicas": 2, "num_cpus": 0.25, "autoscale": {**SLOW, **autoscale}}}


@pytest.fixture
def cluster(registry: Any) -> Iterator[ClusterHandle]:
    with run_cluster(small_config(**autoscaled(max_replicas=3)), actor_classes=FAKE_CLASSES) as handle:
        yield handle


def test_resize_of_an_autoscaled_pool_is_refused_saying_what_to_do(cluster):
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        cluster.resize("decode", 3)
    assert "pool 'decode' is autoscaled (1..3 replicas)" in str(refused.value.cause)
    assert "change decode.autoscale's bounds with `splitserve apply`" in str(refused.value.cause)
    assert cluster.status()["pools"]["decode"]["replicas"] == 2


def test_apply_keeps_an_autoscaled_pools_count_within_the_new_bounds(cluster):
    # the file says replicas 1 (where `up` would start it): the pool keeps the 2 it runs
    same = small_config(decode={"replicas": 1, "num_cpus": 0.25, "autoscale": {**SLOW, "max_replicas": 3}})
    assert cluster.apply(same)["plan"] == []
    assert cluster.status()["pools"]["decode"]["replicas"] == 2
    # new bounds below what runs: the pool comes down to them, drained
    lower = small_config(decode={"replicas": 1, "num_cpus": 0.25, "autoscale": {**SLOW, "max_replicas": 1}})
    assert cluster.apply(lower)["plan"] == [
        "decode: drain and remove 1 replica(s) (2 -> 1), outdated ones first"
    ]
    status = cluster.status()
    assert status["pools"]["decode"]["replicas"] == 1
    assert status["autoscale"]["decode"]["max_replicas"] == 1
    # without autoscale the file's count holds again
    plain = small_config(decode={"replicas": 2, "num_cpus": 0.25})
    assert cluster.apply(plain)["plan"] == ["decode: add 1 replica(s) (1 -> 2)"]
    assert cluster.status()["autoscale"] == {}


def test_the_request_to_rays_autoscaler_reaches_the_cluster_as_the_bundles_wanted(cluster):
    from ray.autoscaler._private.commands import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    from deploy.autoscale.resources import ask_ray_for

    ask_ray_for([({"CPU": 0.25}, {}), ({"CPU": 0.25, "GPU": 1.0}, {"node-type": "h200"})])
    if is_autoscaler_v2():
        pytest.skip("this Ray's autoscaler v2 keeps the request in the GCS, not in its key-value store")
    stored = json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL))
    assert stored == [{"CPU": 0.25}, {"CPU": 0.25, "GPU": 1.0}]
