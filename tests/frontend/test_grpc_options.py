"""The gateway's channels and the workers' servers agree on keepalive, so no idle connection is
sent GOAWAY too_many_pings (seen in a cluster log when servers kept gRPC's default policy).

Watching a channel idle for several keepalive intervals would take minutes; instead this pins
the relation that prevents it, and that every key is one gRPC reads (a misspelt key is ignored
without a word, which is how the server's ping interval once never took effect)."""

from __future__ import annotations

from pathlib import Path

import grpc._cython.cygrpc

from frontend.clients import CHANNEL_OPTIONS
from splitserve import rpc


def test_the_gateway_channels_use_the_splitserve_channel_options():
    assert rpc.channel_options() == CHANNEL_OPTIONS


def test_servers_accept_the_pings_our_channels_send():
    client, server = dict(CHANNEL_OPTIONS), dict(rpc.server_options())
    assert client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.keepalive_permit_without_calls"] == 1  # else one ping per 2 h while idle
    # A ping sooner than the server's minimum is a strike; max_ping_strikes of them, a GOAWAY.
    assert client["grpc.keepalive_time_ms"] >= 2 * server["grpc.http2.min_ping_interval_without_data_ms"]
    assert server["grpc.http2.max_ping_strikes"] >= 1


def test_every_option_key_is_one_grpc_core_knows():
    library = Path(grpc._cython.cygrpc.__file__).read_bytes()
    keys = {key for key, _ in [*CHANNEL_OPTIONS, *rpc.server_options()]}
    unknown = sorted(key for key in keys if key.encode() + b"\0" not in library)
    assert unknown == [], f"gRPC core has no channel argument named {unknown}"
