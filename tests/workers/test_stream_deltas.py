"""A Decode handler waiting for its next update lets go of its server thread once the RPC ends."""

from __future__ import annotations

import queue

from decode_worker.servicer import stream_deltas


class _EndedRpc:
    """The one ServicerContext call stream_deltas makes: the client cancelled, or the server stopped."""

    def is_active(self) -> bool:
        return False


class _LiveRpc:
    def __init__(self, checks_before_ending: int) -> None:
        self.num_checks = 0
        self.checks_before_ending = checks_before_ending

    def is_active(self) -> bool:
        self.num_checks += 1
        return self.num_checks < self.checks_before_ending


def test_an_aborted_request_with_no_further_update_ends_its_stream():
    finished: list[bool] = []
    deltas = stream_deltas("aborted", queue.Queue(), lambda: finished.append(True), _EndedRpc())
    assert list(deltas) == []
    assert finished == []  # ending because the RPC went away is not the request finishing


def test_a_live_rpc_keeps_waiting_through_quiet_spells():
    rpc = _LiveRpc(checks_before_ending=2)
    assert list(stream_deltas("quiet", queue.Queue(), lambda: None, rpc)) == []
    assert rpc.num_checks == 2
