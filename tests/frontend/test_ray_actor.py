"""The gateway as a real Ray actor: no GPU, no torch in its process, serving through its pools."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest
import ray

from frontend.actor import GatewayActor, remote_gateway_actor
from frontend.prefix_router import PrefixAwareRouter
from frontend.router import LeastLoadRouter, RoundRobinRouter
from frontend.settings import GatewaySettings
from tests.frontend.conftest import MODEL
from tests.frontend.fakes import FakeDecode, FakePrefill, FakeWorkerServer


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _torch_loaded(actor: object) -> bool:
    return "torch" in sys.modules


def _assigned_resources(actor: object) -> dict[str, float]:
    return ray.get_runtime_context().get_assigned_resources()


def test_gateway_actor_serves_without_torch_or_gpu(ray_local, tiny_model_path, script):
    servers = [FakeWorkerServer(FakePrefill(script)), FakeWorkerServer(FakeDecode(script))]
    settings = GatewaySettings(model_name=MODEL, model_path=str(tiny_model_path), max_model_len=256)
    actor_class = remote_gateway_actor(num_cpus=0.25)
    actor = actor_class.remote(settings)
    try:
        address = ray.get(actor.start.remote("127.0.0.1", 0), timeout=60)
        ray.get(actor.update_workers.remote([servers[0].address], [servers[1].address]), timeout=30)
        assert ray.get(actor.health.remote(), timeout=30)["ready"] is True
        with httpx.Client(base_url=f"http://{address}", timeout=30) as http:
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert ray.get(actor.__ray_call__.remote(_torch_loaded), timeout=30) is False
        resources = ray.get(actor.__ray_call__.remote(_assigned_resources), timeout=30)
        assert "GPU" not in resources
        ray.get(actor.shutdown.remote(), timeout=30)
        assert ray.get(actor.health.remote(), timeout=30)["serving"] is False
    finally:
        ray.kill(actor)
        for server in servers:
            server.stop()


@pytest.mark.parametrize(
    ("policy", "router_class"),
    [("prefix_aware", PrefixAwareRouter), ("least_load", LeastLoadRouter), ("round_robin", RoundRobinRouter)],
)
def test_the_gateway_actor_routes_by_router_policy(policy: str, router_class: type) -> None:
    settings = GatewaySettings(model_name=MODEL, router_policy=policy, prefix_unit=32)
    actor = GatewayActor(settings, ["10.0.0.1:1"], ["10.0.0.2:1"])
    assert type(actor.router) is router_class
    assert actor.router.prefill_addresses == ("10.0.0.1:1",)
    assert actor.router.decode_addresses == ("10.0.0.2:1",)
