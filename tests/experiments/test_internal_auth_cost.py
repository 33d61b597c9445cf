"""The internal-auth cost benchmark runs end to end at a small size: every case is timed, and a
refused call counts as a call (not an error)."""

from __future__ import annotations

from experiments.internal_auth_cost import interceptor_us, per_call, upload_gbps, upload_options
from splitserve import rpc


def test_the_token_check_alone_is_timed_for_every_case() -> None:
    timings = interceptor_us(num_calls=10, repeats=1)
    assert set(timings) == {"Stats, token held", "Stats, no token", "Health/Check, no token"}
    assert all(us >= 0 for pair in timings.values() for us in pair)


def test_every_kind_of_call_is_timed_against_a_worker_server() -> None:
    timings = per_call("worker", num_calls=3, repeats=1)
    assert len(timings) == 5 and all(wall_us > 0 for wall_us, _ in timings.values())


def test_the_upload_compares_the_servers_options_with_grpcs_defaults() -> None:
    options = upload_options()
    assert next(iter(options.values())) == rpc.server_options()
    assert all(("grpc.http2.bdp_probe", 0) not in o for o in list(options.values())[2:])
    assert upload_gbps(rpc.server_options(), total_bytes=1 << 20, message_bytes=64 << 10, repeats=1) > 0
