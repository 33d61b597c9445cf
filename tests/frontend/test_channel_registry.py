"""The gateway's channels follow the deployment: a worker that left is closed once idle, one in use stays."""

from __future__ import annotations

import asyncio
import contextlib

from frontend.clients import WorkerClients
from frontend.errors import GatewayError
from frontend.load_monitor import LoadMonitor
from frontend.metrics import GatewayMetrics
from frontend.router import LeastLoadRouter
from splitserve.v1 import decode_pb2

GONE, STREAMING, LISTED = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"  # nothing listens on these


def test_retain_closes_idle_channels_of_departed_workers_only():
    async def scenario() -> tuple[set[str], set[str], set[str]]:
        clients = WorkerClients(rpc_timeout_s=2)
        try:
            for address in (GONE, LISTED):
                with contextlib.suppress(GatewayError):
                    await clients.decode_stats(address)  # fails fast: the channel exists, idle
            stream = clients.decode(STREAMING, decode_pb2.DecodeRequest(request_id="r"), timeout_s=30)
            before = clients.addresses
            await clients.retain({LISTED})
            during = clients.addresses  # the open stream keeps its channel
            stream.cancel()
            await clients.retain({LISTED})
            return before, during, clients.addresses
        finally:
            await clients.close()

    before, during, after = asyncio.run(scenario())
    assert before == {GONE, STREAMING, LISTED}
    assert during == {STREAMING, LISTED}
    assert after == {LISTED}


def test_a_load_refresh_drops_channels_of_workers_no_longer_listed():
    router = LeastLoadRouter([], [GONE])

    async def scenario() -> set[str]:
        clients = WorkerClients(rpc_timeout_s=2)
        monitor = LoadMonitor(router, clients, GatewayMetrics("m"), refresh_s=60)
        try:
            await monitor.refresh()  # opens a channel to GONE for its Stats
            assert clients.addresses == {GONE}
            router.update_workers([], [LISTED])
            await monitor.refresh()
            return clients.addresses
        finally:
            await clients.close()

    assert asyncio.run(scenario()) == {LISTED}
