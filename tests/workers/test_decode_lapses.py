"""A decode worker's reservations lapse through one reaper thread, not a timer thread each."""

from __future__ import annotations

import threading
import time

import pytest

from decode_worker.lapses import LapseReaper
from splitserve.rpc import make_channel
from splitserve.sampling_params import SamplingParams
from splitserve.v1 import decode_pb2, decode_pb2_grpc
from tests.workers.client import generate

PROMPT = list(range(3, 40))


def test_the_reaper_fires_due_entries_in_deadline_order_and_never_a_cancelled_one():
    reaper = LapseReaper()
    fired: list[str] = []
    last = threading.Event()
    cancelled = reaper.add(0.01, lambda: fired.append("cancelled"))
    reaper.add(0.05, lambda: fired.append("kept"))
    reaper.add(0.1, last.set)
    assert reaper.cancel(cancelled)
    assert not reaper.cancel(cancelled)  # already gone
    assert last.wait(30)
    assert fired == ["kept"]  # the cancelled one was due first: it would be in the list
    assert reaper.num_pending == 0
    reaper.close()


def test_many_entries_share_one_thread_and_cancelled_ones_leave_the_heap():
    before = threading.active_count()
    reaper = LapseReaper()
    entries = [reaper.add(3600, lambda: None) for _ in range(500)]
    assert threading.active_count() <= before + 1
    for entry in entries:
        reaper.cancel(entry)
    assert reaper.num_pending == 0
    assert len(reaper._heap) <= 64  # compacted, not 500 dead deadlines
    reaper.close()
    assert threading.active_count() <= before
    with pytest.raises(RuntimeError, match="closed"):
        reaper.add(1, lambda: None)


def test_a_failing_callback_does_not_stop_later_ones():
    reaper = LapseReaper()
    done = threading.Event()
    reaper.add(0.01, lambda: 1 / 0)
    reaper.add(0.02, done.set)
    assert done.wait(30)
    reaper.close()


def _reserve(decode_address: str, request_id: str, timeout_s: float) -> decode_pb2.ReserveResponse:
    with make_channel(decode_address) as ch:
        reserved = decode_pb2_grpc.DecodeStub(ch).Reserve(
            decode_pb2.ReserveRequest(
                request_id=request_id, num_prompt_tokens=len(PROMPT), timeout_s=timeout_s
            ),
            timeout=30,
        )
    assert reserved.accepted, reserved.reject_reason
    return reserved


def _abort(decode_address: str, request_id: str) -> None:
    with make_channel(decode_address) as ch:
        decode_pb2_grpc.DecodeStub(ch).Abort(decode_pb2.AbortDecodeRequest(request_id=request_id), timeout=30)


def _record_lapses(servicer, monkeypatch) -> tuple[list[str], threading.Event]:
    """The request ids whose reservations lapse, in order; the event is set at each lapse."""
    lapsed: list[str] = []
    happened = threading.Event()
    original = servicer._lapse

    def recording(rid, reader):
        original(rid, reader)
        lapsed.append(rid)
        happened.set()

    monkeypatch.setattr(servicer, "_lapse", recording)
    return lapsed, happened


def _wait_for_readers_to_end() -> None:
    """Polls (no fixed sleep) until no StateReader thread is left, within 30 s."""
    deadline = time.monotonic() + 30
    while any(t.name.startswith("state-reader-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a StateReader thread outlived its aborted reservation"
        time.sleep(0.01)


def test_many_reservations_start_no_thread_each_that_outlives_them(cluster):
    workers, addr = cluster
    _reserve(addr["decode"], "warm-up", 30)  # the reaper's one thread starts here
    _abort(addr["decode"], "warm-up")
    _wait_for_readers_to_end()
    before = threading.active_count()
    num_reservations = 40
    for i in range(num_reservations):
        _reserve(addr["decode"], f"many-{i}", 30)
    for i in range(num_reservations):
        _abort(addr["decode"], f"many-{i}")
    # each aborted reader's Get ends (cancelled) and its thread with it; a lapse timer each would
    # stay alive for 2 x 30 s
    _wait_for_readers_to_end()
    # the gRPC servers' thread pools may have grown by a few (bounded); a thread per reservation
    # would add num_reservations
    names = " ".join(sorted(t.name for t in threading.enumerate()))
    assert threading.active_count() - before < num_reservations // 4, names
    assert workers["decode"].servicer._lapses.num_pending == 0


def test_a_reservation_without_a_decode_lapses_and_frees_its_room(cluster, store_server, monkeypatch):
    workers, addr = cluster
    servicer = workers["decode"].servicer
    lapsed, happened = _record_lapses(servicer, monkeypatch)
    _reserve(addr["decode"], "never-decoded", 0.5)  # lapses after 2 x 0.5 s
    assert happened.wait(60)
    assert lapsed == ["never-decoded"]
    stats = workers["decode"].stats()
    assert stats["num_reserved"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]
    assert stats["num_free_state_slots"] == stats["num_total_state_slots"]


def test_decoded_and_aborted_reservations_never_lapse(cluster, monkeypatch):
    workers, addr = cluster
    servicer = workers["decode"].servicer
    lapsed, happened = _record_lapses(servicer, monkeypatch)
    _reserve(addr["decode"], "aborted", 4)
    _abort(addr["decode"], "aborted")
    reserved = _reserve(addr["decode"], "decoded", 5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    result = generate(addr["prefill"], addr["decode"], "decoded", PROMPT, params, reserved=reserved)
    assert len(result.token_ids) == 4
    # due after both others: had either stayed pending it would have lapsed first
    _reserve(addr["decode"], "sentinel", 5.5)
    assert happened.wait(60)
    assert lapsed == ["sentinel"]
    assert servicer._lapses.num_pending == 0
