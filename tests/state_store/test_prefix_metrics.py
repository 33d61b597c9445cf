"""The store's prefix-cache counters reach the gateway's /metrics as gauges per store."""

from __future__ import annotations

from frontend.metrics import GatewayMetrics
from splitserve.state.client import StateStoreClient
from splitserve.v1 import store_pb2
from tests.state_store.conftest import make_chunk


def test_a_stores_prefix_counters_become_gauges(client: StateStoreClient) -> None:
    client.put([make_chunk("p", 0, size=100), make_chunk("p", 1, size=100)], owner="prefix-cache", seal=True)
    client.register([b"u0", b"u1"], "p", tail_token_ids=[7], num_tokens=9)
    client.match_prefix([b"u0", b"u1", b"u2"], list(range(20)))  # no tail match: a lookup, no hit
    client.match_prefix([b"u0", b"u1"], [0] * 8 + [7, 9])
    metrics = GatewayMetrics("tiny")
    metrics.set_store_prefix("10.0.0.1:7000", client._stub.Stats(store_pb2.StatsRequest()))  # the raw reply
    text = metrics.render().decode()
    for line in (
        'splitserve_store_prefix_lookups{store="10.0.0.1:7000"} 2.0',
        'splitserve_store_prefix_hit_tokens{store="10.0.0.1:7000"} 9.0',
        'splitserve_store_prefix_entries{store="10.0.0.1:7000"} 1.0',
        'splitserve_store_prefix_bytes{store="10.0.0.1:7000"} 200.0',
        'splitserve_store_prefix_evictions{store="10.0.0.1:7000"} 0.0',
    ):
        assert line in text
