"""A Decode handler waiting for its next update lets go of its server thread once the RPC ends, and
ends its stream UNAVAILABLE once its engine loop has died (the caller fails over at once)."""

from __future__ import annotations

import queue

import grpc
import pytest

from decode_worker.servicer import stream_deltas


class _EndedRpc:
    """The one ServicerContext call stream_deltas makes: the client cancelled, or the server stopped."""

    def is_active(self) -> bool:
        return False


class _Aborted(Exception):
    pass


class _AbortingRpc:
    """An RPC live for 3 checks that records how the handler aborted it (grpc's context.abort
    raises too); a handler that never aborts it sees it end after those checks."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None
        self.num_checks = 0

    def is_active(self) -> bool:
        self.num_checks += 1
        return self.num_checks <= 3

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise _Aborted(details)


class _LiveRpc:
    def __init__(self, checks_before_ending: int) -> None:
        self.num_checks = 0
        self.checks_before_ending = checks_before_ending

    def is_active(self) -> bool:
        self.num_checks += 1
        return self.num_checks < self.checks_before_ending


def test_an_aborted_request_with_no_further_update_ends_its_stream():
    finished: list[bool] = []
    deltas = stream_deltas(
        "aborted", queue.Queue(), lambda: finished.append(True), _EndedRpc(), engine_alive=lambda: True
    )
    assert list(deltas) == []
    assert finished == []  # ending because the RPC went away is not the request finishing


def test_a_live_rpc_keeps_waiting_through_quiet_spells():
    rpc = _LiveRpc(checks_before_ending=2)
    assert list(stream_deltas("quiet", queue.Queue(), lambda: None, rpc, engine_alive=lambda: True)) == []
    assert rpc.num_checks == 2


def test_a_stream_whose_engine_died_ends_unavailable_instead_of_waiting():
    """The engine loop died (a tensor-parallel rank lost): no update will ever come, so the stream
    ends UNAVAILABLE, which the gateway takes as a lost worker and fails over."""
    rpc = _AbortingRpc()
    with pytest.raises(_Aborted):  # not a quiet end after the RPC's checks
        list(stream_deltas("orphaned", queue.Queue(), lambda: None, rpc, engine_alive=lambda: False))
    assert rpc.aborted is not None and rpc.aborted[0] == grpc.StatusCode.UNAVAILABLE
    assert "orphaned" in rpc.aborted[1]

