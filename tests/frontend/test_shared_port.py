"""Several gateway servers on one port (SO_REUSEPORT): the kernel spreads new connections over
them, each also answers on a port of its own, and a server that does not share cannot take the port."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from frontend.app import build_app
from frontend.router import LeastLoadRouter
from frontend.server import GatewayBindError, GatewayServer
from frontend.settings import GatewaySettings
from tests.frontend.conftest import MODEL
from tests.frontend.fakes import FakeDecode, FakePrefill, FakeWorkerServer, Script

NUM_REQUESTS = 60


@contextlib.contextmanager
def shared_gateways(count: int) -> Iterator[list[GatewayServer]]:
    """`count` gateway servers sharing one port, before fake workers; all stopped after."""
    script = Script([5, 6])
    workers = [FakeWorkerServer(FakePrefill(script)), FakeWorkerServer(FakeDecode(script))]
    gateways: list[GatewayServer] = []
    try:
        port = 0
        for _ in range(count):
            router = LeastLoadRouter([workers[0].address], [workers[1].address])
            app = build_app(GatewaySettings(model_name=MODEL, max_model_len=256), None, router)
            gateway = GatewayServer(app, "127.0.0.1", port, shared=True)
            gateway.start()
            port = gateway.port  # the first picks a free port; the others join it
            gateways.append(gateway)
        yield gateways
    finally:
        for gateway in gateways:
            gateway.stop()
        for worker in workers:
            worker.stop()


def _completions_served(own_address: str) -> int:
    """Completions one server answered 200, from the /metrics on its own port."""
    text = httpx.get(f"http://{own_address}/metrics", timeout=30).text
    labels = f'model_name="{MODEL}",route="/v1/completions",status_code="200"'
    prefix = f"splitserve_http_responses_total{{{labels}}}"
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return int(float(lines[0].split()[-1])) if lines else 0


def test_two_servers_on_one_port_each_serve_some_of_the_connections() -> None:
    with shared_gateways(2) as gateways:
        assert gateways[0].address == gateways[1].address
        assert len({g.own_address for g in gateways} | {gateways[0].address}) == 3
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
        for _ in range(NUM_REQUESTS):  # a new connection each: the kernel picks a server each time
            response = httpx.post(f"{gateways[0].url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
        served = [_completions_served(g.own_address) for g in gateways]
    assert sum(served) == NUM_REQUESTS and min(served) > 0, served


def test_a_server_that_does_not_share_cannot_take_a_shared_port() -> None:
    with shared_gateways(1) as (gateway,):
        app = build_app(GatewaySettings(model_name=MODEL), None, LeastLoadRouter())
        with pytest.raises(GatewayBindError, match="another process is listening there"):
            GatewayServer(app, "127.0.0.1", gateway.port).start()
